"""Exceptions that cross a process boundary survive pickling, and a rank's error always reaches the front end."""
from __future__ import annotations

import pickle

import pytest

from latentserve.attention.prefill.base import OwnershipError
from latentserve.distributed.launch import WorkerFailure, Workers
from latentserve.ubatch.runner import UBatchError, UnequalYieldsError
from tests.distributed import rpc
from tests.distributed.helpers import process_gone

# Every exception type of the project a rank may raise to the front end (or a front end to its caller).
ERRORS = [
    UBatchError(1, RuntimeError("injected")),
    UnequalYieldsError("layer 3: ubatch 0 yielded 2 times, ubatch 1 yielded 3 times"),
    OwnershipError("ubatch 0 is reading metadata built for ubatch 1"),
    WorkerFailure("data-parallel engine stopped:\n  rank 1 raised RuntimeError: boom"),
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_round_trips_through_pickle(error):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert vars(copy) == vars(error)


def test_ubatch_error_keeps_its_ubatch_and_message():
    copy = pickle.loads(pickle.dumps(UBatchError(1, KeyError("k"))))
    assert copy.ubatch_id == 1 and str(copy) == "ubatch 1 failed: KeyError: 'k'"


@pytest.mark.parametrize(
    "how,message",
    [
        ("raise", "rank 1 raised .*TwoArgError: rank one: broke"),
        ("answer", "rank 1 sent an answer the front end cannot read: TypeError"),
    ],
)
def test_what_does_not_unpickle_still_names_its_rank(how, message):
    """An error's text comes through instead of the object; the front end stops every rank either way."""
    workers = Workers(rpc.unreadable_worker, 2, (how,))
    pids = workers.receive()
    workers.send([None, None])
    with pytest.raises(WorkerFailure, match=message) as e:
        workers.receive()
    assert e.value.__cause__ is None
    assert all(process_gone(pid) for pid in pids)
