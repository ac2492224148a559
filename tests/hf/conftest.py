"""Tiny pipelines built once per test session, loaded through the real from_pretrained each time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aitune_hf import testing


@pytest.fixture(scope="session")
def pipeline_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {family: testing.build_pipeline(family, tmp_path_factory.mktemp(family)) for family in testing.FAMILIES}


def generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def call_kwargs(family: str) -> dict:
    return {**testing.default_call_kwargs(family, "tiny"), "output_type": "np"}


def run(pipe, family: str):
    """One pipeline call with a fixed seed; returns the image array."""
    return pipe(**call_kwargs(family), generator=generator()).images


def unpatched(modules) -> bool:
    """True when no module carries an instance-level forward left behind by aitune_hf."""
    return all(type(m.__dict__.get("forward")).__name__ != "_ForwardRouter" for m in modules)
