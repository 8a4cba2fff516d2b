"""PreprocessorConfig: flags, the preprocessor's own variables, the older names that keep working, bad values."""

from __future__ import annotations

import pytest

from embedmesh.services.preprocessor.config import PreprocessorConfig


def test_defaults() -> None:
    assert PreprocessorConfig.from_args([], env={}) == PreprocessorConfig()


def test_flags() -> None:
    c = PreprocessorConfig.from_args(
        ["--workers", "a:1, b:2", "--routers", "r:1", "--upload-ttl", "60", "--model-tokenizers", "m=/f,n=/g",
         "--lora-load-on-demand", "--drain-seconds", "2.5", "--max-n", "4", "--tool-call-parser", "hermes"], env={})
    assert (c.workers, c.routers, c.upload_ttl_seconds, c.drain_seconds, c.max_n) == (("a:1", "b:2"), ("r:1",), 60,
                                                                                       2.5, 4)
    assert c.model_tokenizers == (("m", "/f"), ("n", "/g")) and c.lora_load_on_demand is True
    assert PreprocessorConfig.from_args(["--upload-ttl-seconds", "61"], env={}).upload_ttl_seconds == 61


def test_image_settings() -> None:
    c = PreprocessorConfig.from_args(["--image-encoder", "off", "--max-image-pixels", "1000"],
                                     env={"EMBEDMESH_PREPROCESSOR_IMAGE_URL_HOSTS": "img.example.com,cdn.example.org"})
    assert (c.image_encoder, c.max_image_pixels, c.image_url_hosts) == ("off", 1000, ("img.example.com",
                                                                                      "cdn.example.org"))
    d = PreprocessorConfig()
    assert (d.image_encoder, d.image_url_hosts, d.max_image_bytes) == ("efficientnet-lite0", (), 20 << 20)


def test_image_encode_services_and_dinov2_through_them_needs_no_local_projector() -> None:
    c = PreprocessorConfig.from_args(["--image-encoder", "dinov2"], env={
        "EMBEDMESH_PREPROCESSOR_IMAGE_ENCODER_ADDRESS": "e:1,e:2"})
    assert (c.image_encoder_address, c.image_projector) == (("e:1", "e:2"), "")
    assert PreprocessorConfig().image_encoder_address == ()  # default: encoded in this process
    with pytest.raises(ValueError, match="needs image_projector"):
        PreprocessorConfig(image_encoder="dinov2")


def test_an_image_encoder_per_served_model() -> None:
    c = PreprocessorConfig.from_args(["--model-image-encoders", "big=dinov2,text=off",
                                      "--model-image-projectors", "big=/proj"], env={})
    assert c.model_image_encoders == (("big", "dinov2"), ("text", "off"))
    assert c.model_image_projectors == (("big", "/proj"),)
    env = PreprocessorConfig.from_args([], env={"EMBEDMESH_PREPROCESSOR_MODEL_IMAGE_ENCODERS": "text=off"})
    assert env.model_image_encoders == (("text", "off"),) and PreprocessorConfig().model_image_encoders == ()


OLD = {"EMBEDMESH_WORKERS": "w:1,w:2", "EMBEDMESH_TOKENIZER": "/tok", "EMBEDMESH_MAX_EMBEDS_BYTES": "2048",
       "EMBEDMESH_MAX_MESSAGE_BYTES": str(8 << 20), "EMBEDMESH_CACHE_CAPACITY_BYTES": "0", "REDIS_URL": "redis://r",
       "EMBEDMESH_UPLOAD_TTL_SECONDS": "5", "EMBEDMESH_ROUTERS": "r:1", "EMBEDMESH_BLOCK_SIZE": "32",
       "EMBEDMESH_DRAIN_GRACE_SECONDS": "7", "EMBEDMESH_MODEL_TOKENIZERS": "m=/f",
       "EMBEDMESH_TOOL_CALL_PARSER": "hermes",
       "EMBEDMESH_LORA_LOAD_ON_DEMAND": "TRUE", "EMBEDMESH_PREPROCESSOR_HOST": "0.0.0.0",
       "EMBEDMESH_PREPROCESSOR_PORT": "1", "EMBEDMESH_PREPROCESSOR_METRICS_PORT": "2",
       "EMBEDMESH_PREPROCESSOR_MAX_INFLIGHT": "3"}


def test_the_variables_operators_set_before_keep_working() -> None:
    c = PreprocessorConfig.from_args([], env=OLD)
    assert (c.workers, c.tokenizer, c.max_embeds_bytes, c.max_message_bytes) == (("w:1", "w:2"), "/tok", 2048, 8 << 20)
    assert (c.cache_capacity_bytes, c.redis_url, c.upload_ttl_seconds, c.routers) == (0, "redis://r", 5, ("r:1",))
    assert (c.block_size, c.drain_seconds, c.model_tokenizers, c.lora_load_on_demand) == (32, 7.0, (("m", "/f"),), True)
    assert (c.host, c.port, c.metrics_port, c.max_inflight) == ("0.0.0.0", 1, 2, 3)


def test_the_preprocessors_own_variable_beats_the_shared_one_and_a_flag_beats_both() -> None:
    env = {**OLD, "EMBEDMESH_PREPROCESSOR_DRAIN_SECONDS": "1", "EMBEDMESH_PREPROCESSOR_ROUTERS": "own:1",
           "EMBEDMESH_PREPROCESSOR_BLOCK_SIZE": "8"}
    c = PreprocessorConfig.from_args([], env=env)
    assert (c.drain_seconds, c.routers, c.block_size) == (1.0, ("own:1",), 8)
    assert PreprocessorConfig.from_args(["--block-size", "4"], env=env).block_size == 4


@pytest.mark.parametrize(("argv", "needle"), [
    (["--tool-call-parser", "nope"], "tool_call_parser must be one of ['hermes'], got 'nope'"),
    (["--port", "70000"], "port must be in [0, 65535], got 70000"),
    (["--workers", ""], "at least one worker address is required"),
    (["--max-embeds-bytes", "10"], "max_embeds_bytes must be >= 1024"),
    (["--max-message-bytes", "10"], "max_message_bytes must be >= 4 MiB"),
    (["--upload-ttl", "0"], "cache_capacity_bytes must be >= 0 and upload_ttl_seconds >= 1"),
    (["--block-size", "0"], "block_size must be >= 1"),
    (["--max-n", "0"], "max_n and max_prompts must be >= 1"),
    (["--max-messages", "0"], "max_messages must be >= 1 and max_images_per_request >= 0"),
    (["--max-images-per-request", "-1"], "max_messages must be >= 1 and max_images_per_request >= 0"),
    (["--max-inflight", "0"], "max_inflight must be >= 1"),
    (["--drain-seconds", "-1"], "drain_seconds must be >= 0"),
    (["--model-tokenizers", "m"], "--model-tokenizers: 'm' is not name=folder"),
    (["--embedded-router", "--routers", "r:1"], "--embedded-router and --routers are exclusive"),
    (["--image-encoder", "clip"], "invalid choice: 'clip'"),
    (["--max-image-bytes", "10"], "max_image_bytes must be >= 1024 and max_image_pixels >= 1"),
    (["--max-image-pixels", "0"], "max_image_bytes must be >= 1024 and max_image_pixels >= 1"),
    (["--image-fetch-timeout-seconds", "0"], "image_fetch_timeout_seconds must be > 0"),
    (["--model-image-encoders", "m=clip"], "model 'm': kind must be one of efficientnet-lite0, dinov2, off"),
    (["--model-image-encoders", "m=off,m=dinov2"], "model_image_encoders names a model twice"),
    (["--model-image-encoders", "m=dinov2"], "model 'm' uses dinov2 and needs a projector"),
    (["--model-image-projectors", "m=/p"], "model 'm' does not use dinov2"),
])
def test_bad_values_are_usage_errors_naming_the_setting(argv: list[str], needle: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        PreprocessorConfig.from_args(argv, env={})
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "usage: embedmesh-preprocessor" in err
