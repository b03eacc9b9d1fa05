"""Tests for april.config: defaults, TOML/env/override layering, alias, validation, round trip."""

import dataclasses
import json
from pathlib import Path

import pytest

from april.config import (
    AdamImpl,
    AlgoConfig,
    Algorithm,
    BrokerConfig,
    Config,
    ConfigError,
    Mode,
    OffPolicy,
    RunConfig,
    config_to_dict,
    load_config,
    parse_override,
    write_config,
)
from april.ports import endpoint_problem


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "april.toml"
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_validate_and_match_schema() -> None:
    config = load_config(env={})
    assert config == Config()
    assert config.run.mode is Mode.APRIL
    assert config.run.partial_rollout is True
    assert config.algo.algorithm is Algorithm.GRPO
    assert config.algo.offpolicy is OffPolicy.NONE
    assert config.algo.samples_per_batch == 8 * 4
    assert config.run_path() == Path("runs") / "april"
    assert Config(run=RunConfig(run_dir="/tmp/x")).run_path() == Path("/tmp/x")


def test_sections_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().algo.top_k = 5  # type: ignore[misc]


def test_toml_loading(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[run]
name = "exp1"
mode = "sync"
[algo]
algorithm = "gspo"
temperature = 1        # int is fine for a float field
top_k = 20
offpolicy = "tis"
[broker]
debug_ledger = true
""",
    )
    config = load_config(path, env={})
    assert config.run.name == "exp1"
    assert config.run.mode is Mode.SYNC
    assert config.run.partial_rollout is False
    assert config.algo.algorithm is Algorithm.GSPO
    assert config.algo.temperature == 1.0 and isinstance(config.algo.temperature, float)
    assert config.algo.top_k == 20
    assert config.algo.offpolicy is OffPolicy.TIS
    assert config.broker.debug_ledger is True
    assert config.run_path() == Path("runs") / "exp1"
    assert config.data == Config().data  # untouched sections keep defaults


def test_precedence_default_toml_env_override(tmp_path: Path) -> None:
    path = write(tmp_path, "[algo]\ntop_k = 10\nmax_new_tokens = 100\nn_samples_per_prompt = 2\n")
    config = load_config(
        path,
        env={"APRIL_ALGO_MAX_NEW_TOKENS": "200", "APRIL_ALGO_N_SAMPLES_PER_PROMPT": "3"},
        overrides={"algo.n_samples_per_prompt": "5"},
    )
    assert config.algo.temperature == 1.0  # default
    assert config.algo.top_k == 10  # toml over default
    assert config.algo.max_new_tokens == 200  # env over toml
    assert config.algo.n_samples_per_prompt == 5  # override over env


def test_unknown_section(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown section \[foo\] \(known: run, algo, data"):
        load_config(write(tmp_path, "[foo]\nx = 1\n"), env={})


def test_unknown_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r'unknown key "topk" in section \[algo\] \(known: algorithm,'):
        load_config(write(tmp_path, "[algo]\ntopk = 1\n"), env={})


def test_invalid_toml_is_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(write(tmp_path, "[algo\n"), env={})
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml", env={})


@pytest.mark.parametrize(
    ("toml", "pattern"),
    [
        ('[algo]\ntop_k = "5"', r"algo\.top_k = '5' \(str\): expected an int"),
        ("[algo]\ntop_k = 1.5", r"algo\.top_k = 1\.5 \(float\): expected an int"),
        ("[algo]\ntop_k = true", r"algo\.top_k = True \(bool\): expected an int"),
        ("[algo]\ntemperature = true", r"algo\.temperature = True \(bool\): expected a float"),
        ("[data]\nshuffle = 1", r"data\.shuffle = 1 \(int\): expected a bool"),
        ("[worker]\nmodel = 3", r"worker\.model = 3 \(int\): expected a string"),
        (
            '[algo]\nalgorithm = "ppo"',
            r"algo\.algorithm = 'ppo' \(str\): expected one of 'grpo', 'dr_grpo', 'dapo', 'gspo'",
        ),
        ("[algo]\nmode = 1", r'unknown key "mode" in section \[algo\]'),
        ("run = 1", r"expected a \[run\] table"),
    ],
)
def test_wrong_types(tmp_path: Path, toml: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern) as info:
        load_config(write(tmp_path, toml + "\n"), env={})
    assert "\n" not in str(info.value)


def test_env_parsing() -> None:
    env = {
        "APRIL_DATA_SHUFFLE": "off",
        "APRIL_BROKER_DEBUG_LEDGER": "Yes",
        "april_algo_top_k": "7",  # case-insensitive
        "APRIL_ALGO_TOP_P": "0.5",
        "APRIL_ALGO_OFFPOLICY": "Decoupled",
        "APRIL_RUN_MODE": "async",
        "APRIL_WORKER_MODEL": "  Qwen/Qwen3-0.6B",  # strings kept as given
    }
    config = load_config(env=env)
    assert config.data.shuffle is False
    assert config.broker.debug_ledger is True
    assert config.algo.top_k == 7
    assert config.algo.top_p == 0.5
    assert config.algo.offpolicy is OffPolicy.DECOUPLED
    assert config.run.mode is Mode.ASYNC
    assert config.worker.model == "  Qwen/Qwen3-0.6B"


@pytest.mark.parametrize(
    ("var", "value", "pattern"),
    [
        ("APRIL_DATA_SHUFFLE", "maybe", r"SHUFFLE: data\.shuffle = 'maybe' \(str\): expected a bool"),
        ("APRIL_ALGO_TOP_K", "1.5", r"algo\.top_k = '1\.5' \(str\): expected an int"),
        ("APRIL_ALGO_TEMPERATURE", "hot", r"algo\.temperature = 'hot' \(str\): expected a float"),
        ("APRIL_RUN_MODE", "fast", r"run\.mode = 'fast' \(str\): expected one of 'sync', 'april', 'async'"),
    ],
)
def test_env_bad_values(var: str, value: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(env={var: value})


def test_env_unknown_key_names_variable() -> None:
    with pytest.raises(ConfigError, match=r'APRIL_ALGO_TOPK: unknown key "topk" in section \[algo\]'):
        load_config(env={"APRIL_ALGO_TOPK": "3"})


def test_unrelated_april_env_ignored() -> None:
    env = {"APRIL_FOO": "1", "APRIL_FOO_BAR": "x", "APRIL_LOG_LEVEL": "debug", "APRIL": "1", "PATH": "/bin"}
    assert load_config(env=env) == Config()


def test_overrides_typed_and_strings() -> None:
    config = load_config(
        env={},
        overrides={"algo.top_k": 3, "algo.tis_cap": 4, "run.mode": Mode.SYNC, "data.shuffle": "no"},
    )
    assert config.algo.top_k == 3
    assert config.algo.tis_cap == 4.0
    assert config.run.mode is Mode.SYNC
    assert config.data.shuffle is False


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"algo.nope": 1}, r'override algo\.nope: unknown key "nope" in section \[algo\]'),
        ({"nope.x": 1}, r"unknown section \[nope\]"),
        ({"top_k": 1}, r'override top_k: expected "section\.key"'),
        ({"algo.top_k": True}, r"algo\.top_k = True \(bool\): expected an int"),
    ],
)
def test_override_errors(overrides: dict[str, object], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(env={}, overrides=overrides)


def test_partial_rollout_alias(tmp_path: Path) -> None:
    # true sets mode = april, overriding an earlier layer's mode
    path = write(tmp_path, '[run]\nmode = "sync"\n')
    assert load_config(path, env={"APRIL_RUN_PARTIAL_ROLLOUT": "true"}).run.mode is Mode.APRIL
    assert load_config(path, env={}, overrides={"run.partial_rollout": True}).run.partial_rollout
    # false means nothing
    assert load_config(path, env={}, overrides={"run.partial_rollout": "false"}).run.mode is Mode.SYNC
    # a later explicit mode = april is consistent
    path = write(tmp_path, "[run]\npartial_rollout = true\n")
    assert load_config(path, env={"APRIL_RUN_MODE": "april"}).run.mode is Mode.APRIL


def test_partial_rollout_conflicts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"run\.mode = 'async': conflicts with run\.partial_rollout"):
        load_config(write(tmp_path, '[run]\npartial_rollout = true\nmode = "async"\n'), env={})
    path = write(tmp_path, "[run]\npartial_rollout = true\n")
    with pytest.raises(ConfigError, match=r"APRIL_RUN_MODE: run\.mode = 'sync': conflicts"):
        load_config(path, env={"APRIL_RUN_MODE": "sync"})
    with pytest.raises(ConfigError, match=r"override run\.mode: run\.mode = 'sync'"):
        load_config(env={}, overrides={"run.partial_rollout": "on", "run.mode": "sync"})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"rollout_batch_size": 8, "over_sampling_batch_size": 4},
            "algo.over_sampling_batch_size = 4: must be >= algo.rollout_batch_size (8)",
        ),
        ({"rollout_batch_size": 0}, "algo.rollout_batch_size = 0: must be > 0"),
        ({"n_samples_per_prompt": -1}, "algo.n_samples_per_prompt = -1: must be > 0"),
        ({"top_p": 0.0}, "algo.top_p = 0.0: must be in (0, 1]"),
        ({"top_p": 1.5}, "algo.top_p = 1.5: must be in (0, 1]"),
        ({"temperature": 0.0}, "algo.temperature = 0.0: must be > 0"),
        ({"max_staleness": -1}, "algo.max_staleness = -1: must be >= 0"),
        ({"top_k": -1}, "algo.top_k = -1: must be >= 0 (0 = off)"),
        ({"tis_cap": 0.5}, "algo.tis_cap = 0.5: must be >= 1"),
    ],
)
def test_algo_validation_messages(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        AlgoConfig(**kwargs)  # type: ignore[arg-type]
    assert str(info.value) == message


def test_broker_validation_messages() -> None:
    with pytest.raises(ConfigError, match=r"broker\.pub_port = 70000: must be a port in 1\.\.65535"):
        BrokerConfig(pub_port=70000)
    with pytest.raises(ConfigError, match=r"broker\.learner_port = 5555: must differ from broker\.worker_"):
        BrokerConfig(learner_port=5555)
    with pytest.raises(ConfigError, match=r"broker\.heartbeat_interval_s = 0\.0: must be > 0"):
        BrokerConfig(heartbeat_interval_s=0.0)


def test_validation_applies_to_loaded_values(tmp_path: Path) -> None:
    path = write(tmp_path, "[algo]\nover_sampling_batch_size = 4\n")
    with pytest.raises(ConfigError, match=r"over_sampling_batch_size = 4: must be >= algo\.rollout_batch"):
        load_config(path, env={})
    with pytest.raises(ConfigError, match=r"run\.steps = 0: must be > 0"):
        load_config(env={"APRIL_RUN_STEPS": "0"})


def test_write_load_round_trip(tmp_path: Path) -> None:
    config = Config(
        run=RunConfig(name='we"ird\\name\nline2\ttab\x01', mode=Mode.ASYNC, seed=-3),
        algo=AlgoConfig(
            algorithm=Algorithm.DR_GRPO,
            temperature=0.1 + 0.2,
            top_p=1 / 3,
            offpolicy=OffPolicy.MASK,
            dynamic_sampling=True,
        ),
        broker=BrokerConfig(heartbeat_interval_s=1e-7, curve_keys_dir="C:\\keys"),
    )
    path = tmp_path / "sub" / "config.toml"
    write_config(config, path)
    assert load_config(path, env={}) == config
    assert [p.name for p in path.parent.iterdir()] == ["config.toml"]  # no temp file left
    write_config(Config(), path)  # replaces atomically
    assert load_config(path, env={}) == Config()


def test_config_to_dict_is_plain_json() -> None:
    config = Config(run=RunConfig(mode=Mode.SYNC))
    d = config_to_dict(config)
    assert set(d) == {"run", "algo", "data", "broker", "worker", "learner", "weights", "env"}
    assert d["run"]["mode"] == "sync" and type(d["run"]["mode"]) is str
    assert d["algo"]["algorithm"] == "grpo" and type(d["algo"]["algorithm"]) is str
    assert json.loads(json.dumps(d)) == d
    assert d["learner"]["lr"] == 1e-6 and d["broker"]["worker_port"] == 5555


def test_parse_override() -> None:
    assert parse_override("algo.top_k=5") == ("algo.top_k", "5")
    assert parse_override(" worker.model = a=b") == ("worker.model", " a=b")
    assert load_config(env={}, overrides=dict([parse_override("algo.top_k=5")])).algo.top_k == 5
    with pytest.raises(ConfigError, match="no '='"):
        parse_override("algo.top_k")
    with pytest.raises(ConfigError, match=r"no '\.'"):
        parse_override("top_k=5")


def test_the_readme_example_configuration_loads(tmp_path: Path) -> None:
    """The TOML the README shows is a configuration april accepts (sections, keys and values)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    example = readme.split("```toml\n", 1)[1].split("```", 1)[0]
    path = tmp_path / "april.toml"
    path.write_text(example)
    config = load_config(path)
    assert config.weights.transport.value == "auto" and config.weights.bind_host == "0.0.0.0"
    assert config.learner.max_tokens_per_micro_batch == 16384


@pytest.mark.parametrize(
    "address", ["tcp://127.0.0.1:5555", "tcp://head-node.cluster:1", "tcp://[::1]:65535", "ipc:///tmp/april"]
)
def test_connectable_broker_addresses_are_accepted(address: str) -> None:
    assert endpoint_problem(address) is None
    config = load_config(env={}, overrides={"worker.broker": address, "learner.broker": address})
    assert config.worker.broker == config.learner.broker == address


REFUSED_ADDRESSES = [
    "nowhere", "127.0.0.1:5555", "tcp://host", "tcp://host:0", "tcp://host:65536", "ipc://", "", "tcp://*:5555",
    "tcp://a b:1", "tcp://127.0.0.1:5555 ",
]  # fmt: skip


@pytest.mark.parametrize("address", REFUSED_ADDRESSES)
def test_a_broker_address_zeromq_cannot_connect_to_is_a_config_error(address: str) -> None:
    with pytest.raises(ConfigError, match=r"worker\.broker"):
        load_config(env={}, overrides={"worker.broker": address})


@pytest.mark.parametrize(
    "address", ["tcp://127.0.0.1:5555", "tcp://head-node.cluster:1", "tcp://[::1]:65535", *REFUSED_ADDRESSES]
)
def test_endpoint_check_agrees_with_zeromq(address: str) -> None:
    """Against libzmq itself: a DEALER connects to every address the check accepts, and every address
    libzmq refuses the check refuses too (it also refuses ports 0 and above 65535, which libzmq parses
    but no broker listens on)."""
    import zmq

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.connect(address)
        zmq_accepts = True
    except zmq.ZMQError:
        zmq_accepts = False
    finally:
        sock.close(linger=0)
        ctx.term()
    if endpoint_problem(address) is None:
        assert zmq_accepts, address
    if not zmq_accepts:
        assert endpoint_problem(address) is not None, address


def test_adam_impl_picks_the_learners_adamw_on_cuda() -> None:
    assert load_config(env={}).learner.adam_impl is AdamImpl.TORCH  # the one that needs no build
    assert (
        load_config(env={}, overrides={"learner.adam_impl": "deepspeed"}).learner.adam_impl
        is AdamImpl.DEEPSPEED
    )
    with pytest.raises(
        ConfigError, match=r"learner\.adam_impl = 'apex' \(str\): expected one of 'torch', 'deepspeed'"
    ):
        load_config(env={}, overrides={"learner.adam_impl": "apex"})
    with pytest.raises(
        ConfigError, match=r"learner\.adam_impl = 'deepspeed': 'deepspeed' needs learner\.backend"
    ):
        load_config(env={}, overrides={"learner.adam_impl": "deepspeed", "learner.backend": "torch"})
