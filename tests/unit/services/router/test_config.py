"""router.config: the router's flags and ``EMBEDMESH_ROUTER_*`` variables (with the older ``--approx-ttl`` names),
the weights they make, and the bounds a bad value is refused by (a usage error naming the field)."""

from __future__ import annotations

import pytest

from embedmesh.services.router.config import RouterConfig
from embedmesh.services.router.scoring import Weights


def test_defaults() -> None:
    cfg = RouterConfig.from_args([], env={})
    assert (cfg.host, cfg.port, cfg.metrics_port, cfg.seed) == ("127.0.0.1", 50081, 0, None)
    assert cfg.weights == Weights(1.0, 1.0, 0.0)
    assert (cfg.stale_seconds, cfg.sweep_seconds, cfg.approx_ttl_seconds, cfg.approx_max_blocks) == (3.0, 0.5,
                                                                                                    120.0, 100_000)


def test_flags_beat_variables_and_make_the_weights() -> None:
    env = {"EMBEDMESH_ROUTER_PREFILL_WEIGHT": "3", "EMBEDMESH_ROUTER_TEMPERATURE": "0.5",
           "EMBEDMESH_ROUTER_SEED": "9"}
    cfg = RouterConfig.from_args(["--prefill-weight", "2", "--decode-weight", "0.25", "--port", "0"], env=env)
    assert cfg.weights == Weights(prefill=2.0, decode=0.25, temperature=0.5)
    assert (cfg.port, cfg.seed) == (0, 9)


def test_the_older_approx_ttl_names_keep_working() -> None:
    assert RouterConfig.from_args(["--approx-ttl", "5"], env={}).approx_ttl_seconds == 5.0
    assert RouterConfig.from_args([], env={"EMBEDMESH_ROUTER_APPROX_TTL": "6"}).approx_ttl_seconds == 6.0


@pytest.mark.parametrize("kw,message", [
    ({"port": 65536}, "port and metrics_port must be in [0, 65535]"),
    ({"metrics_port": -1}, "port and metrics_port must be in [0, 65535]"),
    ({"prefill_weight": -1.0}, "prefill_weight must be a finite number >= 0"),
    ({"decode_weight": float("inf")}, "decode_weight must be a finite number >= 0"),
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
    ({"stale_seconds": 0.0}, "must be > 0"),
    ({"sweep_seconds": -1.0}, "must be > 0"),
    ({"approx_ttl_seconds": 0.0}, "must be > 0"),
    ({"approx_max_blocks": 0}, "approx_max_blocks must be >= 1"),
    ({"mode": "best"}, "mode must be one of kv, round-robin, random, got 'best'"),
])
def test_bad_values_are_refused(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        RouterConfig(**kw)


def test_a_bad_flag_value_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        RouterConfig.from_args(["--temperature", "-2"], env={})
    assert info.value.code == 2
    assert "temperature must be a finite number >= 0, got -2.0" in capsys.readouterr().err


def test_describe_is_every_field() -> None:
    cfg = RouterConfig(port=0, seed=1)
    assert cfg.describe()["port"] == 0 and cfg.describe()["seed"] == 1
    assert set(cfg.describe()) == {o.field for o in RouterConfig.options()}


def test_the_mode_flag_reaches_the_router() -> None:
    from embedmesh.services.router.main import build

    assert RouterConfig().mode == "kv"
    assert build(RouterConfig.from_args(["--mode", "round-robin"], env={})).router.mode == "round-robin"
