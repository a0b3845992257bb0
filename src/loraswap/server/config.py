"""The server's typed configuration: the engine's, plus the HTTP edge's limits and keys."""

from pathlib import Path

from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..engine.config import EngineConfig
from ..engine.worker import SchedulerConfig


class ServerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engines: list[EngineConfig] = Field(default_factory=lambda: [EngineConfig()], min_length=1,
                                        description="The served base models; the first is the default.")
    host: str = Field("127.0.0.1", description="Interface to listen on.")
    port: int = Field(8888, ge=0, le=65535, description="TCP port (0: any free port).")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description="Queue, batching, fairness.")
    retry_after_s: int = Field(2, ge=1, description="Retry-After sent with 503.")
    max_width: int = Field(2048, ge=64, description="Largest image width.")
    max_height: int = Field(2048, ge=64, description="Largest image height.")
    max_steps: int = Field(100, ge=1, description="Most denoising steps.")
    max_prompt_chars: int = Field(2000, ge=1, description="Longest prompt, characters.")
    max_body_bytes: int = Field(64 * 1024, ge=1024, description="Largest request body.")
    max_images: int = Field(4, ge=1, le=16, description="Most images per OpenAI request (n).")
    max_video_frames: int = Field(121, ge=1, le=1000, description="Most frames in one video (frames, or seconds "
                                  "x fps).")
    max_video_fps: int = Field(60, ge=1, le=240, description="Highest frame rate a video request may ask for.")
    video_fps: int = Field(16, ge=1, le=240, description="The frame rate `seconds` counts in when a video request "
                           "gives none, and the MP4's when the model gives none (Wan 2.1: 16).")
    video_ttl_s: float = Field(3600.0, gt=0, description="How long a finished video job (and its MP4) is kept, "
                               "seconds.")
    max_video_jobs: int = Field(64, ge=1, description="Video jobs kept, finished or not; past it the oldest "
                                "finished one is dropped.")
    max_video_jobs_pending: int = Field(8, ge=1, description="Video jobs queued or in progress at once; more: 503.")
    max_image_bytes: int = Field(20 * 2**20, ge=1024, description="Largest input image (or mask) file, bytes.")
    # at most PIL's own warning threshold: PIL never warns about (nor refuses) an image this server takes
    max_image_pixels: int = Field(4096 * 4096, ge=16 * 16, le=Image.MAX_IMAGE_PIXELS,
                                  description="Most pixels (width x height) of an input image, read from its "
                                  "header before any pixel is decoded.")
    # repr=False: a config printed or logged never shows a key
    api_keys: list[str] = Field(default_factory=list, repr=False,
                                description="Keys accepted as `Authorization: Bearer KEY` on the generation "
                                "routes; none: those routes are open.")
    api_keys_file: Path | None = Field(None, description="A file of API keys, one a line (blank lines and "
                                       "# comments skipped), read at start-up.")
    admin_keys: list[str] = Field(default_factory=list, repr=False,
                                  description="Keys for the adapter routes (load, evict, list); none: those "
                                  "routes take an API key, or are open when there is none.")
    auth_health: bool = Field(False, description="Ask for a key on /health, /ready and /metrics too.")

    @model_validator(mode="after")
    def _room_for_pending_videos(self):
        # a new job makes room by dropping the oldest finished one: there is one while
        # fewer than max_video_jobs_pending are unfinished
        if self.max_video_jobs < self.max_video_jobs_pending:
            raise ValueError(f"max_video_jobs ({self.max_video_jobs}) must be at least max_video_jobs_pending "
                             f"({self.max_video_jobs_pending}): unfinished jobs are never dropped")
        return self

    @model_validator(mode="after")
    def _health_auth_needs_a_key(self):
        if self.auth_health and not (self.api_keys or self.api_keys_file or self.admin_keys):
            raise ValueError("auth_health asks for a key on /health, /ready and /metrics, but no key is set: "
                             "set api_keys, api_keys_file or admin_keys")
        return self
