"""The engine-ready tiny checkpoint of tests/engine (oracle weights + byte tokenizer), for the end-to-end tests."""

import importlib.util
import os
import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def disagg_checkpoint(oracle_checkpoint, tmp_path_factory):
    # tests/engine/conftest.py owns the byte tokenizer; conftest modules are not importable by name
    spec = importlib.util.spec_from_file_location(
        "engine_conftest", Path(__file__).parents[1] / "engine" / "conftest.py")
    engine_conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(engine_conftest)
    directory = tmp_path_factory.mktemp("disagg_ckpt")
    shutil.copytree(oracle_checkpoint, directory, dirs_exist_ok=True)
    engine_conftest.write_byte_tokenizer(directory)
    return directory


# ucxx sets UCX_MEMTYPE_CACHE, which this UCX build does not know: it would warn on every process start
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
