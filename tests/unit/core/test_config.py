"""core/config.py: a frozen dataclass becomes flags + env vars: names, types, precedence, errors, --help, listing."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from embedmesh.core.config import Settings, inverse, option


@dataclass(frozen=True)
class Demo(Settings, service="demo", prog="demo", description="A demo process."):
    host: str = "127.0.0.1"
    """Interface to bind."""
    port: int = 8000
    """Port in [0, 65535]; 100% of it."""
    ratio: float = 0.5
    """A fraction."""
    seed: int | None = None
    """Random seed (none = from the OS)."""
    verbose: bool = False
    """Talk more."""
    requeue_on_start: bool = option(True, flags=("--requeue",), aliases=(inverse("DEMO_NO_REQUEUE"),))
    """Ingest again what a crash left in progress."""
    timeout_seconds: float = option(10.0, flags=("--timeout",),
                                    aliases=("EMBEDMESH_DEMO_TIMEOUT", "EMBEDMESH_SHARED_TIMEOUT"))
    """Seconds to wait."""
    addr: str = option("127.0.0.1:1", env="EMBEDMESH_UPSTREAM_ADDR")
    """Where to send requests."""
    routers: tuple[str, ...] = option((), aliases=("EMBEDMESH_ROUTERS",))
    """Router addresses."""
    models: tuple[tuple[str, str], ...] = option((), metavar="name=folder")
    """Further models."""
    modules: tuple[tuple[str, str], ...] = option((), nargs="*", metavar="NAME=PATH")
    """Adapters to load."""
    models_each: tuple[str, ...] = option(("m0",), repeat=True, metavar="MODEL")
    """Models, one flag each."""
    backend: str = option("a", choices=("a", "b"))
    """Which backend."""
    note: str = option("", help="Given in metadata.")

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")


def parse(argv: list[str], env: dict[str, str] | None = None) -> Demo:
    return Demo.from_args(argv, env or {})


def usage_error(argv: list[str], env: dict[str, str] | None, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as info:
        parse(argv, env)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: demo" in err and "Traceback" not in err
    return err


def test_defaults_come_from_the_dataclass() -> None:
    assert parse([]) == Demo()


def test_flags_are_the_field_names_and_convert_by_type() -> None:
    c = parse(["--host", "0.0.0.0", "--port", "9", "--ratio", "0.25", "--seed", "7", "--verbose", "--no-requeue",
               "--timeout-seconds", "3", "--addr", "x:1", "--routers", "a:1, b:2,", "--models", "m=/f,n=/g",
               "--modules", "l1=p1", "l2=p2", "--backend", "b", "--note", "hi"])
    assert (c.host, c.port, c.ratio, c.seed, c.verbose, c.requeue_on_start) == ("0.0.0.0", 9, 0.25, 7, True, False)
    assert (c.timeout_seconds, c.addr, c.routers) == (3.0, "x:1", ("a:1", "b:2"))
    assert c.models == (("m", "/f"), ("n", "/g")) and c.modules == (("l1", "p1"), ("l2", "p2"))
    assert (c.backend, c.note) == ("b", "hi")


def test_a_repeated_flag_gives_a_tuple_and_its_variable_a_comma_list() -> None:
    assert parse([]).models_each == ("m0",)
    assert parse(["--models-each", "a,b", "--models-each", "c"]).models_each == ("a,b", "c")
    assert parse([], {"EMBEDMESH_DEMO_MODELS_EACH": "x, y"}).models_each == ("x", "y")


def test_older_flag_spellings_keep_working() -> None:
    assert parse(["--timeout", "4"]).timeout_seconds == 4.0
    assert parse(["--no-requeue"]).requeue_on_start is False
    assert parse(["--requeue-on-start"]).requeue_on_start is True


def test_env_names_are_regular_unless_named() -> None:
    env = {"EMBEDMESH_DEMO_HOST": "h", "EMBEDMESH_DEMO_PORT": "1", "EMBEDMESH_DEMO_SEED": "3",
           "EMBEDMESH_DEMO_VERBOSE": "Yes", "EMBEDMESH_UPSTREAM_ADDR": "u:2", "EMBEDMESH_DEMO_ROUTERS": "r:1,r:2",
           "EMBEDMESH_DEMO_MODELS": "a=b", "EMBEDMESH_DEMO_MODULES": "x=y z=w", "EMBEDMESH_DEMO_BACKEND": "b"}
    c = parse([], env)
    assert (c.host, c.port, c.seed, c.verbose, c.addr, c.routers) == ("h", 1, 3, True, "u:2", ("r:1", "r:2"))
    assert (c.models, c.modules, c.backend) == ((("a", "b"),), (("x", "y"), ("z", "w")), "b")


def test_precedence_flag_then_own_variable_then_aliases_in_order_then_default() -> None:
    shared = {"EMBEDMESH_SHARED_TIMEOUT": "3"}
    assert parse([], shared).timeout_seconds == 3.0
    older = {**shared, "EMBEDMESH_DEMO_TIMEOUT": "2"}
    assert parse([], older).timeout_seconds == 2.0
    own = {**older, "EMBEDMESH_DEMO_TIMEOUT_SECONDS": "1"}
    assert parse([], own).timeout_seconds == 1.0
    assert parse(["--timeout", "9"], own).timeout_seconds == 9.0
    assert parse([], {"EMBEDMESH_DEMO_TIMEOUT_SECONDS": "", **shared}).timeout_seconds == 3.0  # empty = unset
    assert parse([], {"EMBEDMESH_ROUTERS": "s:1"}).routers == ("s:1",)


def test_an_inverse_alias_means_the_opposite() -> None:
    assert parse([], {"DEMO_NO_REQUEUE": "1"}).requeue_on_start is False
    assert parse([], {"DEMO_NO_REQUEUE": "0"}).requeue_on_start is True
    assert parse([], {"DEMO_NO_REQUEUE": "1", "EMBEDMESH_DEMO_REQUEUE_ON_START": "1"}).requeue_on_start is True


@pytest.mark.parametrize(("argv", "env", "needle"), [
    (["--port", "abc"], None, "argument --port: invalid int value: 'abc'"),
    (["--port", "70000"], None, "port must be in [0, 65535], got 70000"),  # __post_init__
    (["--backend", "c"], None, "argument --backend: invalid choice: 'c'"),
    (["--models", "nameonly"], None, "--models: 'nameonly' is not name=folder"),
    (["--modules", "x"], None, "--modules: 'x' is not NAME=PATH"),
    ([], {"EMBEDMESH_DEMO_PORT": "x"}, "EMBEDMESH_DEMO_PORT='x' is not a valid int"),
    ([], {"EMBEDMESH_DEMO_PORT": "99999"}, "port must be in [0, 65535], got 99999"),
    ([], {"EMBEDMESH_DEMO_VERBOSE": "maybe"}, "EMBEDMESH_DEMO_VERBOSE='maybe' is not a boolean"),
    ([], {"EMBEDMESH_DEMO_BACKEND": "c"}, "EMBEDMESH_DEMO_BACKEND: invalid choice: 'c'"),
    ([], {"EMBEDMESH_DEMO_MODELS": "a"}, "EMBEDMESH_DEMO_MODELS: 'a' is not name=folder"),
])
def test_bad_values_are_usage_errors_naming_the_flag_or_variable(argv: list[str], env: dict[str, str] | None,
                                                                 needle: str, capsys: pytest.CaptureFixture[str]
                                                                 ) -> None:
    assert needle in usage_error(argv, env, capsys)


def test_help_lists_every_flag_with_its_docstring_variables_and_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse(["--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "A demo process." in out
    for flag in ("--host", "--port", "--ratio", "--seed", "--verbose", "--no-verbose", "--requeue-on-start",
                 "--requeue", "--no-requeue", "--timeout-seconds", "--timeout", "--addr", "--routers", "--models",
                 "--modules", "--backend", "--note"):
        assert f"{flag} " in out or f"{flag}," in out, flag
    assert "Port in [0, 65535]; 100% of it. [env: EMBEDMESH_DEMO_PORT] (default: 8000)" in out
    assert ("Seconds to wait. [env: EMBEDMESH_DEMO_TIMEOUT_SECONDS; also: EMBEDMESH_DEMO_TIMEOUT, "
            "EMBEDMESH_SHARED_TIMEOUT] (default: 10.0)") in out
    assert "also: DEMO_NO_REQUEUE (inverse)" in out
    assert "Given in metadata. [env: EMBEDMESH_DEMO_NOTE] (default: (empty))" in out
    assert "--models name=folder[,...]" in out and "--modules [NAME=PATH ...]" in out


def test_options_list_every_field_for_documentation() -> None:
    rows = {o.field: o for o in Demo.options()}
    assert list(rows) == [f.name for f in Demo.__dataclass_fields__.values()]
    assert all(o.help for o in rows.values())
    t = rows["timeout_seconds"]
    assert (t.flags, t.env, t.aliases, t.default) == (("--timeout-seconds", "--timeout"),
                                                      "EMBEDMESH_DEMO_TIMEOUT_SECONDS",
                                                      ("EMBEDMESH_DEMO_TIMEOUT", "EMBEDMESH_SHARED_TIMEOUT"), "10.0")
    assert rows["requeue_on_start"].aliases == ("!DEMO_NO_REQUEUE",)
    assert (rows["seed"].default, rows["routers"].default, rows["verbose"].default) == ("(none)", "(empty)", "false")
    assert rows["backend"].choices == ("a", "b") and rows["addr"].env == "EMBEDMESH_UPSTREAM_ADDR"
    assert rows["verbose"].switch and not rows["port"].switch


def test_os_environ_is_the_default_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBEDMESH_DEMO_PORT", "4321")
    assert Demo.from_args([]).port == 4321


def test_unsupported_field_types_and_misplaced_inverse_aliases_are_refused() -> None:
    @dataclass(frozen=True)
    class Bad(Settings, service="bad"):
        mapping: dict[str, str] = option(None)

    with pytest.raises(TypeError, match="mapping"):
        Bad.options()

    @dataclass(frozen=True)
    class Bad2(Settings, service="bad"):
        n: int = option(1, aliases=(inverse("X"),))

    with pytest.raises(TypeError, match="inverse"):
        Bad2.options()


def test_describe_is_a_plain_dict() -> None:
    assert Demo(port=5).describe()["port"] == 5
