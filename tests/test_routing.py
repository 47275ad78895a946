"""Routing by measured pace: the split against hand-computed values, the pace's average, and a
session whose second rollout service is far away (every call to it 0.3 s late) giving it less."""

from __future__ import annotations

import anyio
import pytest

import astranb as ab
from astranb.remote.routing import Pace, split
from tests.envs import CountA
from tests.services import in_process_services


def test_equal_services_share_equally():
    assert split(4, [10, 10], [0, 0], [None, None], [0.0, 0.0]) == [2, 2]
    assert split(5, [10, 10], [3, 0], [2.0, 2.0], [0.0, 0.0]) == [1, 4]  # 3 in flight already


def test_a_three_times_faster_service_gets_three_times_the_work():
    # finish times: fast k/3 (1/3, 2/3, 1, 4/3, 5/3, 2, 7/3), slow k (1, 2, 3); ties go to the
    # first; the 8 smallest: fast 1/3..2 (6 of them) and slow 1, 2
    assert split(8, [100, 100], [0, 0], [3.0, 1.0], [0.0, 0.0]) == [6, 2]


def test_room_caps_what_a_service_gets():
    assert split(8, [2, 100], [0, 0], [3.0, 1.0], [0.0, 0.0]) == [2, 6]
    assert split(50, [2, 3], [0, 0], [1.0, 1.0], [0.0, 0.0]) == [2, 3]  # all the room there is
    assert split(3, [0, 5], [0, 0], [1.0, 1.0], [0.0, 0.0]) == [0, 3]
    assert split(0, [5, 5], [0, 0], [1.0, 1.0], [0.0, 0.0]) == [0, 0]


def test_a_service_slow_to_update_its_weights_waits_its_turn():
    # rate 1 each; the second needs 2.5 s for its update: it is first at 3.5 < the first's 4
    assert split(4, [10, 10], [0, 0], [1.0, 1.0], [0.0, 2.5]) == [3, 1]


def test_an_unmeasured_service_counts_at_the_median_pace():
    # measured 1 and 3: median 2 for the new one; finish times 1,2,3 | 1/3,2/3,1,4/3 | 1/2,1,3/2
    assert split(6, [9, 9, 9], [0, 0, 0], [1.0, 3.0, None], [0.0] * 3) == [1, 3, 2]


def test_the_pace_counts_only_time_with_work_and_decays():
    pace = Pace(horizon=1e9)  # no decay: plain sums
    assert pace.rate is None
    pace.observe(2.0, 4, had_work=True)
    pace.observe(5.0, 0, had_work=False)  # idle: not counted
    assert pace.rate == pytest.approx(2.0)
    pace.observe(2.0, 0, had_work=True)  # busy, nothing finished
    assert pace.rate == pytest.approx(1.0)
    fading = Pace(horizon=1.0)
    fading.observe(2.0, 20, had_work=True)  # 10/s
    fading.observe(10.0, 10, had_work=True)  # 1/s for much longer than the horizon
    assert fading.rate == pytest.approx(1.0, rel=1e-3)


def _far_share(tmp_path) -> tuple[int, int]:
    """Episodes sent to the near and the far service in a 20-step run."""
    session, apps, transports = in_process_services(lambda **kw: ab.Session(tmp_path, **kw),
                                                    engine="instant")
    far = transports["http://r1"]
    answer = far.handle_async_request

    async def late(request):
        await anyio.sleep(0.1)
        return await answer(request)

    far.handle_async_request = late
    with session:
        policy = session.policy("solver", ab.models.tiny(), engine="instant")
        session.wire(CountA(), solver=policy)
        run = session.train(steps=20, batch_size=16, group_size=4, max_staleness=1)
        run.wait(progress=False)
        assert run.accounting["lost"] == 0
        assert (run.metrics["staleness_max"] <= 1).all()
        near_n, far_n = (apps[u].state.service.counters["submitted"]
                         for u in ("http://r0", "http://r1"))
    assert near_n + far_n >= 20 * 16
    return near_n, far_n


@pytest.mark.slow  # a 20-step run over in-process services
def test_a_far_service_gets_less_work_than_a_split_blind_to_pace_gives_it(tmp_path,
                                                                          monkeypatch):
    near, far = _far_share(tmp_path / "aware")

    def blind(n, room, inflight, rate, lag):  # the same split, every service at the same pace
        return split(n, room, inflight, [None] * len(room), [0.0] * len(room))

    monkeypatch.setattr("astranb.remote.dispatch.split", blind)
    near_blind, far_blind = _far_share(tmp_path / "blind")
    print(f"far service's share: {far / (near + far):.2f} by pace, "
          f"{far_blind / (near_blind + far_blind):.2f} blind to it")
    assert 0 < far / (near + far) < 0.6 * far_blind / (near_blind + far_blind)
