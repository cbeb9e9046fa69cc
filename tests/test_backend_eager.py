"""Small messages go out before their receive is posted (Gloo patch 0021, issue 20 item 4).

Stock Gloo writes a message only once the receiver said its receive is posted, so a send
posted first waits for that word: a trip per small operation, and two blocking sends that
face each other wait for the op timeout.  With the patch a message of at most 64 KiB goes
out at once and the receiver keeps it until a receive takes it.  What must still hold:
messages of one tag arrive in the order sent whatever their sizes (a large one still waits
for its receive), a receive from any rank takes a kept message and names its sender, and a
kept message of the wrong size fails only the receiving rank's op, and a message sent just
before its sender closed gracefully is still received (stock Gloo's send would have waited
for that receive).  A small receive posted before its message owes its ready word (the
sender does not wait for it) and writes it with its next message; a sender that does wait
announces itself, and that makes the receiver write what it owes at once.
"""

from __future__ import annotations

import json

import pytest

from util import run_rank_script

# serial: the profile measured it filling both cores or timing itself (ci/test.sh)
pytestmark = [pytest.mark.multiprocess, pytest.mark.serial]

OP_TIMEOUT_S = 10     # a send that waits for its receiver's word fails after this
LATE_S = 0.3          # how late a receiving rank posts: the messages are kept by then

RANK = r'''
import json, os, sys, time
import torch, torch.distributed as dist
import hpct.distributed as hd

timeout, late, closed = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
hd.init_process_group(timeout=timeout)
rank = dist.get_rank()
peer = 1 - rank
res = {}

def case(name, fn):
    t0 = time.monotonic()
    try:
        res[name] = fn()
    except Exception as err:  # noqa: BLE001 -- reported to the test
        res[name] = f"ERR:{type(err).__name__}: {str(err)[:300]}"
    res[name + "/s"] = round(time.monotonic() - t0, 3)

def sends_first():
    # Both ranks send before either receives: with the receiver's word awaited, both
    # sends wait for it until the op timeout.
    dist.send(torch.full((4,), float(rank + 1)), peer)
    got = torch.zeros(4)
    dist.recv(got, peer)
    return got.tolist()
case("sends_first", sends_first)

def order(sender, late_side):
    # small, large (above the eager limit: it waits for its receive), small; one tag.
    sizes = [3, 1 << 18, 5]
    if rank == late_side:
        time.sleep(late)
    if rank == sender:
        works = [dist.isend(torch.full((k,), float(i + 1)), peer) for i, k in enumerate(sizes)]
        for w in works:
            w.wait()
        return "sent"
    out = []
    for k in sizes:
        t = torch.zeros(k)
        dist.recv(t, peer)
        out.append([k, float(t.min()), float(t.max())])
    return out
case("order_0", lambda: order(0, 1))
case("order_1", lambda: order(1, 0))
case("early_order_0", lambda: order(0, 0))   # the receives are posted first: readies owed

def any_source():
    if rank == 1:
        for v in (7.0, 8.0):
            dist.send(torch.full((2,), v), 0)
        return "sent"
    time.sleep(late)
    out = []
    for _ in range(2):
        t = torch.zeros(2)
        src = dist.recv(t)
        out.append([src, t.tolist()])
    return out
case("any_source", any_source)

def then_all_reduce(op):
    # op's result or its error on this rank, then whether the group still works.
    try:
        first = op()
    except Exception as err:  # noqa: BLE001
        first = f"ERR:{type(err).__name__}: {str(err)[:300]}"
    t = torch.ones(1)
    dist.all_reduce(t)
    return [first, float(t)]

def late_mismatch():
    # Rank 1 expects 2 elements from rank 0, which sends it 1, and posts late: the kept
    # message is of the wrong size.  Only rank 1's op fails; the group goes on.
    if rank == 1:
        time.sleep(late)
    out = torch.zeros(3 if rank == 1 else 2)
    splits = [2, 1] if rank == 1 else [1, 1]
    inp = torch.full((2,), float(10 + rank))
    def op():
        dist.all_to_all_single(out, inp, output_split_sizes=splits, input_split_sizes=[1, 1])
        return out.tolist()
    return then_all_reduce(op)
case("late_mismatch", late_mismatch)

def early_mismatch():
    # Rank 1 posts first and expects 2 elements from root 0, which scatters 2**18 to each
    # rank: more than may come early, so the root waits for the ready rank 1 owes (rank 1
    # writes nothing else to it in a scatter).  The root's notice must make rank 1 write it
    # at once: the size is then reported, not the op timeout on both ranks.
    if rank == 0:
        time.sleep(late)
    big = 1 << 18
    out = torch.zeros(big if rank == 0 else 2)
    ins = [torch.full((big,), float(10 + j)) for j in range(2)] if rank == 0 else None
    def op():
        dist.scatter(out, ins, src=0)
        return [float(out.min()), float(out.max())]
    return then_all_reduce(op)
case("early_mismatch", early_mismatch)

# The last word: rank 1 sends and closes its group gracefully before rank 0 receives.
if rank == 1:
    dist.send(torch.full((3,), 42.0), 0)
    print("RESULT " + json.dumps(res), flush=True)
    hd.shutdown_all()
    open(closed, "w").close()
    sys.exit(0)
deadline = time.monotonic() + 30
while not os.path.exists(closed) and time.monotonic() < deadline:
    time.sleep(0.01)
def last_word():
    got = torch.zeros(3)
    seen_closed = os.path.exists(closed)
    return [seen_closed, dist.recv(got, 1), got.tolist()]
case("last_word", last_word)
print("RESULT " + json.dumps(res), flush=True)
hd.shutdown_all()
'''


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eager")
    codes, outputs = run_rank_script(tmp, RANK, [str(OP_TIMEOUT_S), str(LATE_S), str(tmp / "closed")], 2,
                                     limit_s=120)
    assert codes == {0: 0, 1: 0}, "\n".join(outputs)
    found = []
    for out in outputs:
        line = [x for x in out.splitlines() if x.startswith("RESULT ")]
        assert line, out
        found.append(json.loads(line[-1][len("RESULT "):]))
    return found


def test_two_small_blocking_sends_that_face_each_other_complete(results):
    for rank, res in enumerate(results):
        assert res["sends_first"] == [float(2 - rank)] * 4, res["sends_first"]
        assert res["sends_first/s"] < OP_TIMEOUT_S / 2


def test_kept_and_waiting_messages_of_one_tag_arrive_in_the_order_sent(results):
    for name, sender in (("order_0", 0), ("order_1", 1), ("early_order_0", 0)):
        receiver = 1 - sender
        assert results[sender][name] == "sent"
        assert results[receiver][name] == [[3, 1.0, 1.0], [1 << 18, 2.0, 2.0], [5, 3.0, 3.0]], name


def test_a_receive_from_any_rank_takes_kept_messages_and_names_the_sender(results):
    assert results[1]["any_source"] == "sent"
    assert results[0]["any_source"] == [[1, [7.0, 7.0]], [1, [8.0, 8.0]]]


def test_a_kept_message_of_the_wrong_size_fails_only_the_receiving_rank(results):
    first0, total0 = results[0]["late_mismatch"]
    first1, total1 = results[1]["late_mismatch"]
    assert first0 == [10.0, 11.0]
    assert isinstance(first1, str) and "holds 8 bytes, received 4" in first1, first1
    assert total0 == total1 == 2.0


def test_a_waiting_sender_of_more_than_was_asked_gets_the_owed_ready_at_once(results):
    first0, total0 = results[0]["early_mismatch"]
    first1, total1 = results[1]["early_mismatch"]
    assert first0 == [10.0, 10.0]
    assert isinstance(first1, str) and f"holds 8 bytes, received {4 << 18}" in first1, first1
    assert results[1]["early_mismatch/s"] < OP_TIMEOUT_S / 2, results[1]
    assert total0 == total1 == 2.0


def test_a_message_sent_before_its_sender_closed_is_still_received(results):
    assert results[0]["last_word"] == [True, 1, [42.0, 42.0, 42.0]], results[0]["last_word"]
