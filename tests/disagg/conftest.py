"""Settings for the disaggregation tests (their checkpoint is the root conftest's engine_checkpoint)."""

import os

# ucxx sets UCX_MEMTYPE_CACHE, which this UCX build does not know: it would warn on every process start
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
