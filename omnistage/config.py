"""The deploy file: one YAML describing the whole stack, validated by pydantic.

`omnistage serve`, each `omnistage stage`/`gateway` process and `omnistage deploy render`
read the same model. Unknown or bad fields are refused at start with the field's path.

Which file: `--config FILE`, else `$OMNISTAGE_CONFIG`, else `deploy/omnistage.yaml` under the
current directory, else the packaged one, `omnistage/data/omnistage.yaml` (`deploy/omnistage.yaml`
links to it; `default_config_path`). Command-line flags override the file; the file overrides the
built-in defaults.

Ports: process `P` (the gateway or a stage replica) serves gRPC on `P` and Prometheus metrics
on `P + metrics.port_offset` (1000 by default), both on `host`; the gateway also serves HTTP on
`gateway.http_port` (8000). `--port P` moves the whole stack: gateway `P` (HTTP `P + 50`), the
k-th stage of the topology `P + 100 * k` (replica i adds i).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from omnistage.topology import (
    DISAGGREGATED,
    EDGES,
    PIPELINE,
    PROCESSES,
    STAGES,
    StageDef,
    pipeline,
    stage_def,
    stages_below,
)

StageName = str  # one of topology.PROCESSES
EdgeModeName = Literal["async_chunk", "full_payload"]


class ConfigError(ValueError):
    """A deploy file or flag that cannot be served; the message names the field."""


class _Strict(BaseModel):
    # YAML's .inf / .nan parse as floats: no limit or size here means them (rendered, they overflowed)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, strict=True)


class StageConfig(_Strict):
    replicas: int = Field(1, ge=1, le=64)
    device: str = Field("cpu", pattern=r"^(cpu|cuda(:\d+)?)$")
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32", description="auto: the checkpoint's own (config.json `dtype`), float32 when it names none")
    base_port: int = Field(ge=1024, le=65535, description="replica i listens on base_port + i")
    threads: int = Field(1, ge=1, le=256, description="torch intra-op threads per replica")
    max_num_seqs: int = Field(16, ge=1, le=4096, description="requests per engine step")
    max_num_batched_tokens: int = Field(2048, ge=1, description="token budget per engine step")
    chunked_prefill: bool = Field(True, description="split a prompt larger than the step's budget over steps")
    cache_capacity_tokens: int | None = Field(
        None, ge=1, description="KV cache tokens over all admitted requests (and, in a prefill role, ended ones "
        "whose KV waits to be sent); null: unbounded"
    )
    batching: Literal["exact", "fast"] = Field(
        "exact", description="exact: each request bitwise as alone (parity); fast: one GEMM per layer over "
        "every request's rows, close but not bitwise (thinker and talker: models/batching.py; Qwen2.5-Omni's "
        "token2wav: one DiT pass per ODE step over every due request)")  # fmt: skip

    @property
    def prefill_chunk(self) -> int | None:
        """Exact batching splits a long prompt at fixed points, whatever else is in the step:
        chunks of the step's token budget less one token for each other request it may hold (so
        a chunk fits next to a full step of decodes), and at least half the budget (a budget
        below max_num_seqs; a chunk then waits for a step with fewer decodes). Fast batching
        lets a chunk take what the step leaves (engine/scheduler.py)."""
        if self.batching != "exact" or not self.chunked_prefill:
            return None
        budget = self.max_num_batched_tokens
        return max(budget - self.max_num_seqs + 1, (budget + 1) // 2)

    def engine_limits(self) -> dict[str, Any]:
        """This stage's scheduling arguments of `Engine`."""
        return {"max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
                "cache_capacity_tokens": self.cache_capacity_tokens, "chunked_prefill": self.chunked_prefill,
                "prefill_chunk": self.prefill_chunk}  # fmt: skip


class ThinkerConfig(StageConfig):
    """The thinker's block; with `disaggregated: true` its `prefill` and `decode` blocks run it
    as two roles (their own replicas, devices and ports) and the block's own process fields
    are not used."""

    disaggregated: bool = Field(False, description="run the thinker as a prefill and a decode role")
    prefix_cache_tokens: int = Field(
        0, ge=0, le=1 << 30, description="positions of ended requests' KV cache kept for prompts that start with "
        "the same tokens and media (a conversation's next turn, a shared system prompt), which then prefill only "
        "the rest; on top of cache_capacity_tokens. A hit changes the last bits of what follows it (exact mode's "
        "parity with generate() is for prompts prefilled whole); 0: off")  # fmt: skip
    prefill: StageConfig = StageConfig(base_port=7101, cache_capacity_tokens=65536)
    decode: StageConfig = StageConfig(base_port=7151, cache_capacity_tokens=65536)


def _thinker_only_cache(stage: StageConfig, name: str) -> None:
    """Only the thinker's requests are admitted against a token cache. Elsewhere the field
    bounded a request's steps instead (the talker's two per frame, code2wav's 2**30: every
    request refused), which no one setting it meant."""
    if stage.cache_capacity_tokens is not None:
        raise ValueError(f"cache_capacity_tokens: only the thinker's KV cache is bounded in tokens; the {name}'s "
                         "requests are bounded by max_num_seqs (remove it)")  # fmt: skip


class TalkerConfig(StageConfig):
    cuda_graphs: bool = Field(
        False, description="on CUDA: replay the code predictor's per-frame loop as CUDA graphs captured at "
        "start-up for batches 1, 2, 4, ... up to max_num_seqs (at most 256; Qwen3-Omni; a family without one "
        "ignores it), greedy and sampled (the talker's default)")

    @model_validator(mode="after")
    def _no_token_cache(self) -> TalkerConfig:
        _thinker_only_cache(self, "talker")
        return self

    @model_validator(mode="after")
    def _graphs_on_cuda(self) -> TalkerConfig:
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError(f"cuda_graphs needs a CUDA device (device: {self.device})")
        return self


class Code2WavConfig(StageConfig):
    chunk_frames: int = Field(25, ge=1, le=1000)
    first_chunk_frames: int = Field(2, ge=1, le=1000)
    first_chunk_frames_idle: int | None = Field(
        1, ge=1, le=1000, description="the first chunk's frames when the talker makes a request's first frame "
        "with no other request open there: an idle pipeline gives the first audio a talker step sooner, and its "
        "next chunk comes well before that audio has played; under load first_chunk_frames, whose longer first "
        "audio covers a slower next chunk. null: first_chunk_frames always")
    left_context_frames: int = Field(25, ge=0, le=1000)
    streaming: Literal["exact", "windowed"] = "exact"
    # A request's backlog (code2wav behind its talker) goes through in steps of at most this many
    # frames (Qwen2.5-Omni: or its window's reach, if more), so one long reply neither holds the
    # engine (the other requests' audio, cancellation) nor, for a decoder whose cost grows faster
    # than its length (Qwen2.5-Omni's DiT), costs more.
    max_frames_per_step: int = Field(250, ge=1, le=1 << 20, description="most frames of one request "
                                     "decoded in one step; the rest wait for the next")  # fmt: skip

    @model_validator(mode="after")
    def _no_token_cache(self) -> Code2WavConfig:
        _thinker_only_cache(self, "code2wav")
        return self

    @model_validator(mode="after")
    def _idle_first_chunk_no_longer(self) -> Code2WavConfig:
        if self.first_chunk_frames_idle is not None and self.first_chunk_frames_idle > self.first_chunk_frames:
            raise ValueError(f"first_chunk_frames_idle ({self.first_chunk_frames_idle}) must not exceed "
                             f"first_chunk_frames ({self.first_chunk_frames}): it is the idle pipeline's shorter one")
        return self

    def chunk_target(self, frames_done: int, idle: bool = False) -> int:
        """Frames in a request's next decode: `first_chunk_frames` for its first, then as many as
        were already decoded, up to `chunk_frames` (2, 2, 4, 8, 16, 25, 25, ... by default). The
        first audio waits for few frames, and no later chunk is longer than the audio already
        out, so a pipeline faster than real time delivers it before the client has played what it
        has (a fixed 25 after the first left 4 frames of audio to cover 25: at c=16 on 2 cores,
        clients ran dry for 0.4-0.7 s, p99). The code2wav stage decodes when that many are final;
        a talker feeding a causal decoder sends its frames on the same schedule.

        `idle`: the talker made the request's first frame with no other request open there. Its
        first chunk is then `first_chunk_frames_idle` (1, 1, 2, 4, 8, 16, 25, ... by default: one
        decode more), and the talker tells code2wav to decode it at once (edges.DECODE_NOW). The
        chunks after it keep the rule, so a burst of requests that arrives just after (the pipeline
        no longer idle) has one frame's time, not two, to get the second chunk out before the first
        has played."""
        if frames_done == 0:
            if idle and self.first_chunk_frames_idle is not None:
                return self.first_chunk_frames_idle
            return self.first_chunk_frames
        return min(self.chunk_frames, frames_done)


class GatewayConfig(_Strict):
    port: int = Field(50051, ge=1, le=65535, description="gRPC (Gateway.Generate); replica i adds i")
    http_port: int | None = Field(8000, ge=1, le=65535, description="OpenAI-compatible HTTP; replica i adds i; "
                                  "null: no HTTP")  # fmt: skip
    replicas: int = Field(1, ge=1, le=64)
    max_in_flight: int = Field(256, ge=1, le=1 << 20, description="requests one gateway replica takes at once; "
                               "one more is refused RESOURCE_EXHAUSTED (HTTP 429) at once, rather than queued "
                               "into a wait that ends at its deadline")  # fmt: skip
    cors_allow_origins: list[str] = Field(default_factory=list, description="browser origins the HTTP API "
                                          "answers across origins (CORS), e.g. [\"https://app.example\"] or "
                                          "[\"*\"]; empty: none")  # fmt: skip


class MediaConfig(_Strict):
    """What the gateway accepts of audio, images and video in requests (checked before and after
    decoding; a part over a limit fails its request with INVALID_ARGUMENT)."""

    max_part_bytes: int = Field(20 * 1024 * 1024, ge=1024, le=1 << 30, description="encoded bytes of one part")
    max_request_bytes: int = Field(64 * 1024 * 1024, ge=64 * 1024, le=1 << 31,
                                   description="a whole Generate request (the gateway's receive limit)")  # fmt: skip
    max_audio_seconds: float = Field(300.0, gt=0, description="one audio clip or a video's sound track "
                                     "(and never more than the model's feature extractor takes)")  # fmt: skip
    max_video_seconds: float = Field(600.0, gt=0)
    video_fps: float = Field(2.0, gt=0, le=60, description="frames sampled per second of a video file")
    max_video_frames: int = Field(128, ge=1, le=4096, description="frames of one video after sampling (a longer "
                                  "video file is sampled at this many frames over its length)")  # fmt: skip
    max_image_pixels: int = Field(64 * 1024 * 1024, ge=1, description="width x height of an image or frame")
    max_decoded_bytes: int = Field(1 << 30, ge=1 << 20, le=1 << 36,
                                   description="all media of one request once decoded (RGB pixels at 3 bytes, "
                                   "audio at 4 bytes a sample), checked before each image or frame is "
                                   "converted")  # fmt: skip
    decoded_cache_bytes: int = Field(256 * 1024 * 1024, ge=0, le=1 << 36,
                                     description="decoded media kept for requests that send the same part again "
                                     "(a chat client sends its whole conversation every turn), least recently used "
                                     "out first; 0: off")  # fmt: skip


class MetricsConfig(_Strict):
    enabled: bool = Field(True, description="each process serves Prometheus metrics")
    port_offset: int = Field(1000, ge=1, le=60000, description="metrics port = the process's port + this")


# One mode per edge of the topology: `thinker_to_talker`, `talker_to_code2wav`, ...
EdgesConfig = create_model(  # type: ignore[call-overload]
    "EdgesConfig", __base__=_Strict, **{edge: (EdgeModeName, "async_chunk") for edge in EDGES}
)


class FailoverConfig(_Strict):
    """A caller whose downstream replica is lost mid-request (UNAVAILABLE: killed, reset,
    draining) opens the call again on another replica and sends the request again from its
    Start; the caller's own client sees no error and the same greedy output."""

    attempts: int = Field(3, ge=0, le=10, description="replays per request and hop; 0 turns failover off")
    replica_wait_s: float = Field(30.0, ge=0, le=3600,
                                  description="a hop that lost a replica under a request: until this long after "
                                  "(or one serves again), its replays and new requests wait for one to serve when "
                                  "none does (the only one restarting), within their deadlines; 0: replay at "
                                  "once")  # fmt: skip
    replay_budget_bytes: int = Field(64 * 1024 * 1024, ge=0, le=1 << 34,
                                     description="what a request may have sent downstream and still be "
                                     "replayed (kept in memory until it ends)")  # fmt: skip
    replay_memory_bytes: int = Field(1 << 30, ge=0, le=1 << 40,
                                     description="what all requests of one stage process may keep for replay "
                                     "together; a request whose next output would pass it is no longer replayed on "
                                     "its hop (the caller above replays it, up to the gateway)")  # fmt: skip


class TlsConfig(_Strict):
    """Optional TLS. One certificate and key serve every process (a Kubernetes TLS secret
    mounted at the same path in each pod); `ca_file` verifies peers. The certificate must name
    the addresses callers use (SAN), or set `server_name` to a name it holds."""

    gateway: bool = Field(False, description="TLS on the gateway's gRPC and HTTP ports (clients need not "
                          "present a certificate; use an API key)")  # fmt: skip
    stages: bool = Field(False, description="mutual TLS on every hop to a stage: a stage accepts only "
                         "callers with a certificate signed by ca_file")  # fmt: skip
    cert_file: str | None = Field(None, description="PEM certificate chain of this process")
    key_file: str | None = Field(None, description="PEM private key of cert_file")
    ca_file: str | None = Field(None, description="PEM roots that sign the peers' certificates")
    server_name: str | None = Field(None, description="name to verify in the servers' certificates instead "
                                    "of the host dialled")  # fmt: skip

    @model_validator(mode="after")
    def _files_given(self) -> TlsConfig:
        if (self.gateway or self.stages) and not (self.cert_file and self.key_file):
            raise ValueError("tls: gateway or stages on needs cert_file and key_file")
        if self.stages and not self.ca_file:
            raise ValueError("tls.stages: mutual TLS needs ca_file to verify the callers")
        return self


class TimeoutsConfig(_Strict):
    input_wait_timeout_s: float = Field(600.0, ge=0, description="0 disables")
    output_stall_timeout_s: float = Field(60.0, ge=0, description="a request whose caller (a stage's, or the "
                                          "gateway's client) reads none of its outputs this long fails (it is "
                                          "paused meanwhile); 0 disables")  # fmt: skip
    request_timeout_s: float = Field(600.0, gt=0, le=86400, description="a request's deadline when the client "
                                     "sets none, and the furthest it may set")  # fmt: skip
    startup_timeout_s: float = Field(180.0, gt=0, le=86400, description="a process's start, checkpoint loading "
                                     "included")  # fmt: skip
    drain_grace_s: float = Field(30.0, ge=0, le=3600)
    keepalive_s: float = Field(10.0, ge=0, le=3600, description="every hop's connection is pinged this often; "
                               "a peer that does not answer within as long again (frozen, cut off) is lost: its "
                               "calls fail UNAVAILABLE and are replayed on another replica; 0 disables, else at "
                               "least 1")  # fmt: skip

    @field_validator("keepalive_s")
    @classmethod
    def _off_or_at_least_a_second(cls, v: float) -> float:
        if 0 < v < 1:
            raise ValueError("0 (off) or at least 1 second: a shorter ping loop would busy every connection")
        return v


class _HeadConfig(_Strict):
    model: str | None = Field(None, min_length=1, description="checkpoint directory; None = the built-in tiny "
                              "checkpoint")  # fmt: skip
    served_model_name: str | None = Field(None, min_length=1, description="the name clients see; None: the "
                                          "checkpoint's")  # fmt: skip
    max_model_len: int | None = Field(None, ge=2, description="cap on prompt + generated tokens; None: the model's")
    audio_output: bool = Field(True, description="false: text only, the chain ends at the thinker (a checkpoint "
                               "without a talker, such as Qwen3-Omni's Thinking or Captioner); requests for "
                               "audio are refused")  # fmt: skip
    host: str = Field("127.0.0.1", description="the address every process listens on: an IP address "
                      "(127.0.0.1, ::1, 0.0.0.0, ...); callers dial it")  # fmt: skip
    gateway: GatewayConfig = GatewayConfig()

    @field_validator("served_model_name")
    @classmethod
    def _a_name_clients_can_send(cls, name: str | None) -> str | None:
        if name is not None and name != name.strip():
            raise ValueError(f"{name!r} starts or ends with whitespace, which a client's model name would not")
        return name

    @field_validator("host")
    @classmethod
    def _an_ip_address(cls, host: str) -> str:
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(f"{host!r} is not an IP address (127.0.0.1, ::1, 0.0.0.0, ...); names are not "
                             "resolved here") from None  # fmt: skip
        return host


_SETTINGS: dict[str, type[StageConfig]] = {"stage": StageConfig, "thinker": ThinkerConfig,
                                           "talker": TalkerConfig, "code2wav": Code2WavConfig}  # fmt: skip
# Where a role's settings live: thinker-prefill -> thinker.prefill
_ROLE_PATHS = {"thinker-prefill": ("thinker", "prefill"), "thinker-decode": ("thinker", "decode")}
# One settings block per stage of the topology, named after it (after the head fields).
_StagesConfig = create_model(  # type: ignore[call-overload]
    "_StagesConfig",
    __base__=_HeadConfig,
    **{
        s.name: (_SETTINGS[s.settings], _SETTINGS[s.settings](base_port=s.default_port, **s.defaults))
        for s in PIPELINE
    },
)


class DeployConfig(_StagesConfig):  # type: ignore[misc,valid-type]
    edges: EdgesConfig = EdgesConfig()  # type: ignore[valid-type]
    timeouts: TimeoutsConfig = TimeoutsConfig()
    failover: FailoverConfig = FailoverConfig()
    tls: TlsConfig = TlsConfig()
    routing: Literal["round_robin", "least_outstanding"] = Field(
        "round_robin", description="which replica of the next stage gets a request (omnistage/server/routing.py; "
        "least_outstanding also keeps a conversation's turns on one thinker replica where it keeps prefixes)")
    max_message_bytes: int = Field(4 * 1024 * 1024, ge=64 * 1024, le=1024 * 1024 * 1024)
    shm: bool = Field(True, description="same-host shared-memory path for large tensors")
    metrics: MetricsConfig = MetricsConfig()
    media: MediaConfig = MediaConfig()

    @model_validator(mode="before")
    @classmethod
    def _stage_defaults(cls, data: Any) -> Any:
        """A stage block given in part keeps its stage's defaults (port, cache) for the rest."""
        if not isinstance(data, dict):
            return data
        data = dict(data)  # copied on the way down: the caller's dicts stay as they were
        for s in (*PIPELINE, *DISAGGREGATED):
            *parents, leaf = _ROLE_PATHS.get(s.name, (s.name,))
            node = data
            for key in parents:
                if not isinstance(node.get(key), dict):
                    break
                child = dict(node[key])
                node[key] = child
                node = child
            else:
                if isinstance(node.get(leaf), dict):
                    node[leaf] = {"base_port": s.default_port, **s.defaults, **node[leaf]}
        return data

    @model_validator(mode="after")
    def _ports_do_not_collide(self) -> DeployConfig:
        used: dict[int, str] = {}
        for port, role, field in self._ports():
            if not 1 <= port <= 65535:
                raise ValueError(f"{field}: {role} would listen on port {port}, outside 1..65535")
            if port in used:
                raise ValueError(f"{field}: port {port} of {role} collides with {used[port]}")
            used[port] = role
        return self

    @model_validator(mode="after")
    def _thinker_roles(self) -> DeployConfig:
        """With the thinker split, its own process fields run nothing: one set away from its
        default, and not what both roles have, is refused naming where it belongs (the roles do
        not inherit it); and the roles batch alike (a decode goes on from the prefill's cache:
        exact mode's parity needs both)."""
        t = self.thinker
        if not t.disaggregated:
            return self
        if t.prefix_cache_tokens:
            raise ValueError("thinker.prefix_cache_tokens: a split thinker keeps no prefixes (its prefill role sends "
                             "each cache to a decode role); set it to 0 or thinker.disaggregated to false")  # fmt: skip
        defaults = {name: f.default for name, f in StageConfig.model_fields.items()} | stage_def("thinker").defaults
        for name in StageConfig.model_fields:
            value = getattr(t, name)
            shared = value == getattr(t.prefill, name) == getattr(t.decode, name)  # as `serve --device` sets all
            if name != "base_port" and value != defaults[name] and not shared:
                raise ValueError(f"thinker.{name}: {getattr(t, name)!r} is not used with thinker.disaggregated: "
                                 f"true; set it in thinker.prefill and thinker.decode")  # fmt: skip
        if t.prefill.batching != t.decode.batching:
            raise ValueError(f"thinker.prefill.batching ({t.prefill.batching}) and thinker.decode.batching "
                             f"({t.decode.batching}) must agree: the decode role goes on from the prefill's "
                             "cache")  # fmt: skip
        # the cache crosses in the prefill's dtype (each role checks the other's at the first
        # request too; `auto` is the checkpoint's, known only there)
        if t.prefill.dtype != t.decode.dtype and "auto" not in (t.prefill.dtype, t.decode.dtype):
            raise ValueError(f"thinker.prefill.dtype ({t.prefill.dtype}) and thinker.decode.dtype "
                             f"({t.decode.dtype}) must agree: the decode role goes on from the prefill's cache")
        return self

    def _ports(self) -> list[tuple[int, str, str]]:
        """(port, role, the config field that sets it) of every port the stack listens on."""
        out = [(self.gateway.port + i, f"gateway[{i}]", "gateway.port") for i in range(self.gateway.replicas)]
        for name in self.stage_names():
            field = f"{config_path(name)}.base_port"
            out += [(p, f"{name}[{i}]", field) for i, p in enumerate(self.stage_ports(name))]
        if self.metrics.enabled:
            offset = self.metrics.port_offset
            out += [(p + offset, f"{role} metrics", "metrics.port_offset") for p, role, _ in list(out)]
        out += [(p, f"gateway[{i}] http", "gateway.http_port") for i, p in enumerate(self.http_ports())]
        return out

    def http_ports(self) -> list[int]:
        """The gateway replicas' HTTP ports (none when HTTP is off)."""
        if self.gateway.http_port is None:
            return []
        return [self.gateway.http_port + i for i in range(self.gateway.replicas)]

    def ports(self) -> list[tuple[int, str]]:
        """Every port the stack listens on, with the role of its process: gRPC and metrics."""
        return [(port, role) for port, role, _ in self._ports()]

    def metrics_port(self, port: int) -> int | None:
        """The metrics port of the process serving `port` (None: metrics are off)."""
        return port + self.metrics.port_offset if self.metrics.enabled else None

    def chain(self) -> tuple[StageDef, ...]:
        """The stage processes this config runs, first (the gateway's downstream) to last."""
        stages = pipeline(self.thinker.disaggregated)
        return stages if self.audio_output else tuple(s for s in stages if s.stream == "thinker")

    def downstream(self, name: StageName) -> StageName | None:
        """The stage process after `name` in this config's chain (None: the last)."""
        below = stages_below(name, self.stage_names())
        return below[0] if below else None

    def stage_names(self) -> tuple[StageName, ...]:
        return tuple(s.name for s in self.chain())

    def stage(self, name: StageName) -> StageConfig:
        if name not in PROCESSES:
            raise KeyError(f"unknown stage {name!r}; expected one of {', '.join(PROCESSES)}")
        node: Any = self
        for key in _ROLE_PATHS.get(name, (name,)):
            node = getattr(node, key)
        return node  # type: ignore[no-any-return]

    def edge_mode(self, upstream: StageName, downstream: StageName) -> str:
        """The mode of the edge between two stage processes; the hop between the thinker's two
        roles carries the thinker -> talker edge's mode on (the decode role applies it)."""
        up, down = stage_def(upstream).stream, stage_def(downstream).stream
        if up == down:
            down = stage_def(downstream).downstream or down
        return str(getattr(self.edges, f"{up}_to_{down}"))

    def stage_ports(self, name: StageName) -> list[int]:
        s = self.stage(name)
        return [s.base_port + i for i in range(s.replicas)]

    def address(self, port: int) -> str:
        """`host:port` to dial (`[host]:port` for IPv6)."""
        return f"[{self.host}]:{port}" if ":" in self.host else f"{self.host}:{port}"

    def stage_target(self, name: StageName) -> str:
        """gRPC target that spreads calls over the stage's local replicas."""
        scheme = "ipv6:" if ":" in self.host else "ipv4:"
        return scheme + ",".join(self.address(p) for p in self.stage_ports(name))


PORT_STRIDE = 100  # --port P: the k-th stage's replicas start at P + PORT_STRIDE * k
HTTP_PORT_OFFSET = 50  # --port P: the gateway's HTTP port is P + 50


def port_layout(port: int) -> dict[str, int]:
    """Overrides that move the whole stack to `port`: the gateway there (its HTTP port 50 up),
    each stage a stride up."""
    out = {"gateway.port": port, "gateway.http_port": port + HTTP_PORT_OFFSET}
    for k, name in enumerate(STAGES, start=1):
        out[f"{name}.base_port"] = port + PORT_STRIDE * k
    # the thinker's roles share its stride: prefill at its port, decode half a stride up
    thinker = out["thinker.base_port"]
    out |= {"thinker.prefill.base_port": thinker, "thinker.decode.base_port": thinker + PORT_STRIDE // 2}
    return out


def config_path(name: StageName) -> str:
    """The dotted path of a stage process's settings block: talker, thinker.prefill, ..."""
    return ".".join(_ROLE_PATHS.get(name, (name,)))


def default_config_path(cwd: Path | None = None) -> Path:
    """The deploy file `serve` reads when given none (see the module docstring)."""
    env = os.environ.get("OMNISTAGE_CONFIG")
    if env:
        return Path(env)
    local = (cwd or Path.cwd()) / "deploy" / "omnistage.yaml"
    if local.is_file():
        return local
    return Path(__file__).resolve().parent / "data" / "omnistage.yaml"


def _format_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = "unknown field" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"{loc}: {msg}")
    return f"{source}: invalid deploy config: " + "; ".join(lines)


def parse_config(data: dict[str, Any] | None, source: str = "config") -> DeployConfig:
    try:
        return DeployConfig.model_validate(data or {})
    except ValidationError as e:
        raise ConfigError(_format_error(e, source)) from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader that refuses a key given twice in one mapping (plain YAML keeps the
    last: a second `talker:` block silently replaced the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: what it brings in may be overridden
                continue
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            try:
                twice = key in seen
            except TypeError:  # a list or mapping as a key
                raise yaml.constructor.ConstructorError(None, None, "a key must be a plain value",
                                                        key_node.start_mark) from None  # fmt: skip
            if twice:
                raise yaml.constructor.ConstructorError(None, None, f"the key {key!r} is given twice",
                                                        key_node.start_mark)  # fmt: skip
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path | None) -> DeployConfig:
    if path is None:
        return DeployConfig()
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"deploy config not found: {p}")
    try:
        data = yaml.load(p.read_text(), Loader=_UniqueKeyLoader)  # a SafeLoader
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML ({e})") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{p}: the deploy config must be a mapping")
    return parse_config(data, str(p))


def apply_overrides(cfg: DeployConfig, overrides: dict[str, Any]) -> DeployConfig:
    """Dotted-path overrides from CLI flags, e.g. {"talker.replicas": 2, "model": "/ckpt"}."""
    data = cfg.model_dump()
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            if not isinstance(node.get(key), dict):
                raise ConfigError(f"--{dotted}: unknown field")
            node = node[key]
        node[leaf] = value
    return parse_config(data, "command line")


def parse_replicas(spec: str) -> dict[str, int]:
    """`talker=2,thinker-decode=3` -> {"talker.replicas": 2, "thinker.decode.replicas": 3}."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, count = part.partition("=")
        if not sep or name not in (*PROCESSES, "gateway"):
            raise ConfigError(f"--replicas: expected STAGE=N with STAGE in {', '.join(PROCESSES)}; got {part!r}")
        key = f"{config_path(name)}.replicas"
        if key in out:  # (the last one won in silence)
            raise ConfigError(f"--replicas: {name} given twice ({spec!r})")
        try:
            out[key] = int(count)
        except ValueError:
            raise ConfigError(f"--replicas: {name} count must be an integer, got {count!r}") from None
    return out


def check_replicas_run(cfg: DeployConfig, counts: Mapping[str, int]) -> None:
    """`--replicas NAME=N` (serve, bench; `counts` as `parse_replicas` gives them) for a process
    this config does not run is an error, not ignored."""
    running = {*cfg.stage_names(), "gateway"}
    names = {f"{config_path(n)}.replicas": n for n in (*PROCESSES, "gateway")}
    for field_path, count in counts.items():
        name = names[field_path]
        if name not in running:
            why = ("thinker.disaggregated is false: one thinker process runs" if name.startswith("thinker-")
                   else "audio_output is false: no speech stages run" if name in ("talker", "code2wav")
                   else "")  # fmt: skip
            raise ConfigError(f"--replicas {name}={count}: this stack runs no {name} process"
                              + (f" ({why})" if why else "") + f"; it runs {', '.join(sorted(running))}")  # fmt: skip


def dump_config(cfg: DeployConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(), sort_keys=False)
