#!/bin/bash
# The unattended tokenize of a corpus on one CPU VM (docs/data.md, "Pods: tokenize C4 once"): a Compute Engine
# startup script, run as root at every boot. Its parameters are the VM's metadata: src (this checkout as a
# .tar.gz on gs://, made by `git archive`), data, vocab, out, workers (optional), as `diloco data tokenize` takes
# them. Every boot installs once and resumes the tokenize (finished parts are kept); at the end, done or failed,
# the log goes to OUT.log and the VM powers off, so its cores stop billing. A store is complete when
# `diloco data info OUT` shows its manifest; if not, read OUT.log and `gcloud compute instances start` the VM.
set -uo pipefail
meta() { curl -fs -H 'Metadata-Flavor: Google' \
  "http://metadata.google.internal/computeMetadata/v1/instance/attributes/$1" || true; }
SRC=$(meta src) DATA=$(meta data) VOCAB=$(meta vocab) OUT=$(meta out) WORKERS=$(meta workers)
LOG=/var/log/diloco-tokenize.log
exec > >(tee -a "$LOG") 2>&1
finish() { [ -n "$OUT" ] && gcloud storage cp "$LOG" "$OUT.log"; poweroff; }
trap finish EXIT
for v in SRC DATA VOCAB OUT; do
  [ -n "${!v}" ] || { echo "tokenize_vm: the VM's metadata '${v,,}' is not set"; exit 2; }
done
export EPATH_USE_TF=false  # gs:// through gcsfs, as on the TPU hosts
set -e
if [ ! -x /opt/diloco/venv/bin/diloco ]; then
  apt-get update -q && apt-get install -yq python3-venv
  mkdir -p /opt/diloco/src && gcloud storage cat "$SRC" | tar -xz -C /opt/diloco/src
  python3 -m venv /opt/diloco/venv
  /opt/diloco/venv/bin/pip install -q -c /opt/diloco/src/requirements.lock -e "/opt/diloco/src[tpu]"
fi
/opt/diloco/venv/bin/diloco data tokenize --data "$DATA" --vocab "$VOCAB" --out "$OUT" ${WORKERS:+--workers "$WORKERS"}
