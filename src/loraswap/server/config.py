"""The server's typed configuration: the engine's, plus the HTTP edge's limits and keys, and
the webhooks of video jobs."""

import base64
import binascii
from pathlib import Path
from typing import Annotated, Literal

from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from loraswap.engine.config.engine import EngineConfig
from loraswap.engine.config.scheduling import SchedulerConfig
from loraswap.flags import ADAPTERS, SCHEDULING, SERVER, Flag

SECRET_PREFIX = "whsec_"
SECRET_BYTES = (24, 64)  # what Standard Webhooks asks of a secret
MAKE_SECRET = ("python -c \"import base64, secrets; print('whsec_' + base64.b64encode(secrets.token_bytes(32))"
               ".decode())\"")


class WebhookConfig(BaseModel):
    """How a video job's webhook is signed, where it may go and how it is retried."""

    model_config = ConfigDict(extra="forbid")

    # repr=False: never printed, never in an error message
    secret: Annotated[str | None, Flag(SERVER, name="webhook-secret")] = Field(
        None, repr=False, description="The key webhooks are signed with (Standard Webhooks: whsec_ and the base64 of "
        "24 to 64 random bytes); none: a job asking for a webhook is refused. Prefer LORASWAP_WEBHOOK_SECRET or "
        "--config: a flag shows in `ps`.")
    allow: Annotated[list[str], Flag(SERVER, name="webhook-allow")] = Field(
        default_factory=list, description="A host webhooks may be sent to: host or host:port, fnmatch; * is any public "
        "host (never a loopback, private or metadata address, unless named); plain http only to a host named. None "
        "given: every webhook URL is refused.")
    attempts: Annotated[int, Flag(SERVER, name="webhook-attempts")] = Field(
        8, ge=1, le=30, description="Tries of a webhook before it is given up: a failure or an answer other than "
        "2xx is tried again.")
    retry_s: Annotated[float, Flag(SERVER, name="webhook-retry-s")] = Field(
        5.0, gt=0, le=3600, description="Seconds before a failed webhook is tried again, doubled at each failure "
        "(5, 10, 20, ... seconds).")
    timeout_s: Annotated[float, Flag(SERVER, name="webhook-timeout-s")] = Field(
        10.0, gt=0, le=300, description="The most one try of a webhook takes, connecting and answering included, "
        "seconds.")
    workers: Annotated[int, Flag(SERVER, name="webhook-workers")] = Field(
        4, ge=1, le=64, description="Webhooks being sent at once (threads of their own, never the event loop's), "
        "one at a time to any one host.")
    pending: Annotated[int, Flag(SERVER, name="webhook-pending")] = Field(
        1024, ge=1, le=100_000, description="Webhooks owed at once, all keys together: those of jobs not finished "
        "and those not yet delivered; a job asking for one past it is refused (503).")
    pending_per_key: Annotated[int, Flag(SERVER, name="webhook-pending-per-key")] = Field(
        32, ge=1, le=100_000, description="Webhooks one API key may be owed at once (its unfinished jobs' and its "
        "undelivered ones); more: 503. Without API keys only --webhook-pending counts.")

    @field_validator("secret")
    @classmethod
    def _a_standard_secret(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            raw = base64.b64decode(value.removeprefix(SECRET_PREFIX), validate=True)
        except (binascii.Error, ValueError):
            raw = b""
        if not value.startswith(SECRET_PREFIX) or not SECRET_BYTES[0] <= len(raw) <= SECRET_BYTES[1]:
            raise ValueError(f"a webhook secret is {SECRET_PREFIX} and the base64 of {SECRET_BYTES[0]} to "
                             f"{SECRET_BYTES[1]} random bytes; make one with {MAKE_SECRET}")
        return value


class ServerConfig(BaseModel):
    """The HTTP edge and its models. Fields marked with a `Flag` are settings of `loraswap serve`."""

    model_config = ConfigDict(extra="forbid")

    engines: list[EngineConfig] = Field(default_factory=lambda: [EngineConfig()], min_length=1,
                                        description="The served base models; the first is the default.")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description="Queue, batching, fairness.")
    retry_after_s: Annotated[int, Flag(SCHEDULING)] = Field(
        2, ge=1, description="Retry-After sent with a 503, seconds.")
    host: Annotated[str, Flag(SERVER)] = Field("127.0.0.1", description="Interface to listen on.")
    port: Annotated[int, Flag(SERVER)] = Field(8888, ge=0, le=65535, description="TCP port (0: any free one).")
    drain_s: Annotated[float, Flag(SERVER)] = Field(
        10.0, ge=0, le=3600, description="On SIGTERM (or Ctrl-C): queued requests are answered 503 at once, running "
        "ones have this long to finish, then stop at their next denoising step (answered 503), seconds. Not with "
        "--ray: Ray Serve drains its replicas.")
    log_level: Annotated[Literal["debug", "info", "warning", "error"], Flag(SERVER)] = Field(
        "info", description="The least important log lines written: debug, info, warning or error (debug also shows "
                            "the libraries' warnings at start-up).")
    log_format: Annotated[Literal["text", "json"], Flag(SERVER)] = Field(
        "text", description="Log lines as text, or json: one object a line (time, level, logger, message, request_id "
                            "on a request's lines, and their fields), the access log's too.")
    otel: Annotated[bool, Flag(SERVER)] = Field(
        False, description="Send OpenTelemetry traces of the requests (pip install 'loraswap[tracing]'), where the "
                           "OTEL_* variables say (default: OTLP over HTTP to localhost:4318). Setting "
                           "OTEL_TRACES_EXPORTER or OTEL_EXPORTER_OTLP_ENDPOINT turns it on too.")
    # repr=False: a config printed or logged never shows a key
    api_keys: Annotated[list[str], Flag(SERVER, name="api-key")] = Field(
        default_factory=list, repr=False,
        description="A key clients send as `Authorization: Bearer KEY` on the generation routes; none: those "
                    "routes are open. Prefer LORASWAP_API_KEY (keys separated by spaces), --api-keys-file or "
                    "--config: a flag shows in `ps`.")
    api_keys_file: Annotated[Path | None, Flag(SERVER)] = Field(
        None, description="A file of API keys, one a line (blank lines and # comments skipped), read at start-up.")
    admin_keys: Annotated[list[str], Flag(SERVER, name="admin-key")] = Field(
        default_factory=list, repr=False,
        description="A key for the adapter routes (load, evict, list); none: those routes take an "
                    "API key, or are open when there is none. Prefer LORASWAP_ADMIN_KEY or --config.")
    auth_health: Annotated[bool, Flag(SERVER)] = Field(
        False, description="Require a key on /health, /ready and /metrics too.")
    max_width: Annotated[int, Flag(SERVER)] = Field(2048, ge=64, description="Largest image width.")
    max_height: Annotated[int, Flag(SERVER)] = Field(2048, ge=64, description="Largest image height.")
    max_steps: Annotated[int, Flag(SERVER)] = Field(100, ge=1, description="Most denoising steps.")
    max_prompt_chars: Annotated[int, Flag(SERVER)] = Field(
        2000, ge=1, description="Longest prompt, characters.")
    prompt_adapter_tags: Annotated[Literal["on", "off"], Flag(ADAPTERS)] = Field(
        "on", description="on: `<lora:NAME:WEIGHT>` (and `<lyco:...>`) in a prompt names an adapter, as in A1111, "
                          "and is cut out of the text; off: prompts go to the text encoder untouched.")
    max_body_bytes: Annotated[int, Flag(SERVER, name="max-body-kb", unit="KiB", scale=1024)] = Field(
        64 * 1024, ge=1024, description="Largest request body.")
    max_images: Annotated[int, Flag(SERVER)] = Field(
        4, ge=1, le=16, description="Most images in one OpenAI request (n).")
    max_video_frames: Annotated[int, Flag(SERVER)] = Field(
        121, ge=1, le=1000, description="Most frames in one video (frames, or seconds x fps).")
    max_video_fps: Annotated[int, Flag(SERVER)] = Field(
        60, ge=1, le=240, description="Highest frame rate a video request may ask for.")
    video_fps: Annotated[int, Flag(SERVER)] = Field(
        16, ge=1, le=240, description="The frame rate a video's seconds count in when the request gives none, and "
                                      "the MP4's when the model gives none (Wan 2.1: 16).")
    video_ttl_s: Annotated[float, Flag(SERVER)] = Field(
        3600.0, gt=0, description="How long a finished video (and its MP4) is kept, seconds.")
    max_video_jobs: Annotated[int, Flag(SERVER)] = Field(
        64, ge=1, description="Video jobs kept, finished or not; past it a new job drops its own API key's oldest "
                              "finished one, never another key's before it expires (then: 503 with Retry-After).")
    max_video_jobs_pending: Annotated[int, Flag(SERVER)] = Field(
        8, ge=1, description="Video jobs queued or in progress at once; more: 503.")
    max_video_jobs_per_key: Annotated[int, Flag(SERVER)] = Field(
        16, ge=1, description="Video jobs one API key keeps, finished or not; past it that key's oldest finished one "
                              "is dropped. Without API keys only --max-video-jobs counts.")
    max_video_jobs_pending_per_key: Annotated[int, Flag(SERVER)] = Field(
        4, ge=1, description="Video jobs one API key has queued or in progress at once; more: 503. Without API keys "
                             "only --max-video-jobs-pending counts.")
    state_dir: Annotated[Path | None, Flag(SERVER)] = Field(
        None, description="Folder of the server's durable state: video jobs and their MP4s, kept across restarts "
                          "(default: ~/.cache/loraswap/state). One server a folder.")
    resume_videos: Annotated[bool, Flag(SERVER)] = Field(
        True, description="Make again, after a restart, the videos that were queued or being made; off: they "
                          "fail with the code server_restarted.")
    webhooks: WebhookConfig = Field(default_factory=WebhookConfig, description="Video jobs' webhooks: secret, "
                                    "allowed hosts, tries.")
    image_url_ttl_s: Annotated[float, Flag(SERVER)] = Field(
        3600.0, gt=0, description="How long an image answered by URL (OpenAI's response_format \"url\") is kept in "
                                  "the state folder and served, seconds (across restarts too).")
    image_url_disk_bytes: Annotated[int, Flag(SERVER, name="image-url-max-mb", unit="MiB", scale=2**20)] = Field(
        1024 * 2**20, ge=2**20, description="Disk the images answered by URL may take, all keys together; past it "
                                            "the key holding the most loses its oldest first.")
    list_adapters_as_models: Annotated[bool, Flag(SERVER)] = Field(
        False, description="List the adapters the server may serve in GET /v1/models (and GET /v1/models/{id}) "
                           "beside the hosted models, and the adapter folders' in A1111's GET /sdapi/v1/loras with "
                           "their files' metadata (which may name a trainer's paths); off: the hosted models only, "
                           "and no LoRAs.")
    image_metadata: Annotated[bool, Flag(SERVER)] = Field(
        True, description="Write into each generated image what made it: A1111's infotext and a JSON record (prompt, "
                          "negative prompt, steps, guidance, seed, size, model, each adapter's weight and SHA-256) in "
                          "PNG text chunks, or in EXIF for JPEG and WebP; a request's \"metadata\": false leaves it "
                          "out of its images.")
    max_image_bytes: Annotated[int, Flag(SERVER, name="max-image-mb", unit="MiB", scale=2**20)] = Field(
        20 * 2**20, ge=1024, description="Largest input image (or mask) file.")
    # at most PIL's own warning threshold: PIL never warns about (nor refuses) an image this server takes
    max_image_pixels: Annotated[int, Flag(SERVER)] = Field(
        4096 * 4096, ge=16 * 16, le=Image.MAX_IMAGE_PIXELS, description="Most pixels (width x height) of an input "
        "image, read from its header before any pixel is decoded.")
    auto_size_max_pixels: Annotated[int, Flag(SERVER)] = Field(
        1024 * 1024, ge=16 * 16, description="With an input image and no size asked, the size generated is the "
        "image's, scaled down to at most this many pixels and to the model's --max-size (its shape kept); asked "
        "for, a size is held to --max-width, --max-height and --max-size.")
    max_decode_bytes: Annotated[int, Flag(SERVER, name="max-decode-mb", unit="MiB", scale=2**20)] = Field(
        1024 * 2**20, ge=2**20, description="Input images and masks being decoded at once, all requests together, "
        "counted as their pixels' bytes (width x height x channels x bytes per channel, the copies a decode makes "
        "included); past it a request waits up to 30 s for room, then gets 503.")

    @model_validator(mode="after")
    def _room_for_pending_videos(self):
        # a new job makes room by dropping the oldest finished one: there is one while
        # fewer than max_video_jobs_pending are unfinished
        if self.max_video_jobs < self.max_video_jobs_pending:
            raise ValueError(f"max_video_jobs ({self.max_video_jobs}) must be at least max_video_jobs_pending "
                             f"({self.max_video_jobs_pending}): unfinished jobs are never dropped")
        if self.max_video_jobs_per_key < self.max_video_jobs_pending_per_key:
            raise ValueError(f"max_video_jobs_per_key ({self.max_video_jobs_per_key}) must be at least "
                             f"max_video_jobs_pending_per_key ({self.max_video_jobs_pending_per_key}): unfinished "
                             "jobs are never dropped")
        return self

    @model_validator(mode="after")
    def _health_auth_needs_a_key(self):
        if self.auth_health and not (self.api_keys or self.api_keys_file or self.admin_keys):
            raise ValueError("auth_health asks for a key on /health, /ready and /metrics, but no key is set: "
                             "set api_keys, api_keys_file or admin_keys")
        return self
