"""`ask_gcs`: a query of Ray's control store that never answers becomes an error naming what it waited for."""

from __future__ import annotations

import threading

import pytest

from hybridflow.single_controller.ray.base import ask_gcs


def test_an_unanswered_query_times_out_naming_what_it_waited_for():
    never = threading.Event()
    with pytest.raises(TimeoutError, match=r"did not answer the node table within 0.2 s"):
        ask_gcs("the node table", never.wait, timeout_s=0.2)
    never.set()  # let the left-behind thread end


def test_answers_and_errors_come_back_to_the_caller():
    assert ask_gcs("a count", lambda: 3) == 3

    def broken():
        raise ConnectionError("GCS address unknown")

    with pytest.raises(ConnectionError, match="GCS address unknown"):
        ask_gcs("the node table", broken)
