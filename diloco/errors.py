"""One error type for bad input: it names the field and says what would be valid."""


class ConfigError(ValueError):
    """Raised before any compilation when a config field, path or input is invalid."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")
