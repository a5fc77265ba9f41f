"""Shared fixtures: the default configuration, the repository's config.json, GPU skipping."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from main import parse_args
from utils import read_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def args() -> argparse.Namespace:
    """The training defaults, as `main.py` with no flags would use them."""
    return parse_args([])


@pytest.fixture(scope="session")
def config() -> dict:
    return read_config(ROOT / "config.json")


def make_args(**overrides) -> argparse.Namespace:
    """Default arguments with some fields replaced."""
    args = parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
