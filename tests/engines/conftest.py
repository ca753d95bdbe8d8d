"""Fixtures of the engine tests."""

import pytest
import zmq


@pytest.fixture
def ctx():
    """A ZeroMQ context for the test, terminated after it."""
    c = zmq.Context()
    yield c
    c.term()
