import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("WANDB_SILENT", "true")
if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n N`: N workers share the cores, each computes on one of them
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; run on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2_folder():
    from kvoffload.model.weights import smollm2_folder

    return smollm2_folder()


@pytest.fixture(name="tiny_config")
def tiny_config_fixture():
    """tests.tiny_models.tiny_config: the small hand-built model shapes (`tiny_config(num_layers=4)`)."""
    from tests.tiny_models import tiny_config

    return tiny_config
