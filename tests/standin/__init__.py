"""A local stand-in of Cloud TPU and Cloud Storage for the launch tests (see README.md here)."""
