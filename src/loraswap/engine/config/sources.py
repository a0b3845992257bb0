"""Where a model's adapters come from: the folder, the hub, and files elsewhere (URLs, Civitai,
S3) kept in the download folder. Settings only: the sources are built from them where they
are used (`adapters/sources/choose.py:build_sources`, called by the engine for its store)."""

import os
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from loraswap.adapters.sources.choose import SourceSettings
from loraswap.adapters.sources.civitai import CIVITAI_API
from loraswap.adapters.sources.remote import RemoteSettings
from loraswap.flags import ADAPTERS, Flag


class SourcesConfig(BaseModel):
    """The adapter sources a model serves, each off until its setting turns it on."""

    model_config = ConfigDict(extra="forbid")

    adapters: Annotated[Path | None, Flag(ADAPTERS)] = Field(
        None, description="Folder of .safetensors adapters; an adapter's id is its path under it without the "
                          "suffix.")
    hub: Annotated[bool, Flag(ADAPTERS)] = Field(
        False, description="Also serve hub adapters (owner/name, or owner/name@revision); HF_HUB_OFFLINE=1 serves "
                           "them from the huggingface_hub cache alone.")
    hub_allow: Annotated[list[str], Flag(ADAPTERS)] = Field(
        default_factory=lambda: ["*"], description="fnmatch pattern of hub ids served.")
    hub_deny: Annotated[list[str], Flag(ADAPTERS)] = Field(
        default_factory=list, description="fnmatch pattern of hub ids refused (403).")
    hub_cache_dir: Annotated[Path | None, Flag(ADAPTERS)] = Field(
        None, description="huggingface_hub's cache folder (default: HF_HUB_CACHE).")
    url_allow: Annotated[list[str], Flag(ADAPTERS)] = Field(
        default_factory=list, description="A host adapters may be fetched from by URL: host or host:port, fnmatch; "
        "* is any public host (never a loopback, private or metadata address, unless named); plain http only from "
        "a host named. None given: URLs are refused.")
    civitai: Annotated[bool, Flag(ADAPTERS)] = Field(
        False, description="Serve Civitai adapters (civitai:MODEL@VERSION, or an AIR) through Civitai's API, "
                           "checked against the SHA256 it lists; a token from CIVITAI_TOKEN or "
                           "--civitai-token-file.")
    civitai_api: Annotated[str | None, Flag(ADAPTERS)] = Field(
        None, description="Civitai's API base, or a mirror's (default: https://civitai.com/api); turns --civitai "
                          "on.")
    civitai_token_file: Annotated[Path | None, Flag(ADAPTERS)] = Field(
        None, description="A file holding a Civitai API token (default: the CIVITAI_TOKEN variable).")
    s3: Annotated[bool, Flag(ADAPTERS)] = Field(
        False, description="Serve adapters from S3 buckets (s3://bucket/key), with the standard AWS settings "
                           "(AWS_* variables, profiles, instance roles).")
    s3_endpoint_url: Annotated[str | None, Flag(ADAPTERS)] = Field(
        None, description="An S3-compatible store's endpoint (MinIO, R2, ...); turns --s3 on.")
    download_dir: Annotated[Path | None, Flag(ADAPTERS)] = Field(
        None, description="Folder of the adapters fetched by URL or from Civitai, kept across restarts (default: "
                          "~/.cache/loraswap/downloads).")
    download_timeout_s: Annotated[float, Flag(ADAPTERS)] = Field(
        600.0, gt=0, description="Longest one download (URL, Civitai, S3) may take, s, however steadily its host "
                                 "sends: a host dripping bytes is cut off (502).")
    download_cache_gb: Annotated[float, Flag(ADAPTERS)] = Field(
        20.0, gt=0, description="Disk the downloads may take, GiB; the least recently used are dropped past it.")
    max_adapter_mb: Annotated[float, Flag(ADAPTERS)] = Field(
        2048, gt=0, description="Largest adapter file, MiB.")
    source: object | None = Field(None, exclude=True, description="An adapter source object handed in by code "
                                  "(tests, hub); not a setting.")

    @property
    def max_adapter_bytes(self) -> int:
        return int(self.max_adapter_mb * 2**20)

    def settings(self) -> SourceSettings:
        """These settings as the sources take them (`choose.build_sources`), the Civitai token read."""
        remote = RemoteSettings(tuple(self.url_allow), self._civitai_api(), self._civitai_token(),
                                self.s3 or self.s3_endpoint_url is not None, self.s3_endpoint_url,
                                self.max_adapter_bytes, total_timeout=self.download_timeout_s)
        return SourceSettings(self.adapters, self.hub, self.hub_cache_dir, tuple(self.hub_allow),
                              tuple(self.hub_deny), self.max_adapter_bytes, remote, self.download_dir,
                              int(self.download_cache_gb * 2**30), given=self.source)

    def _civitai_api(self) -> str | None:
        return self.civitai_api or (CIVITAI_API if self.civitai else None)

    def _civitai_token(self) -> str | None:
        """The token: --civitai-token-file's first line, else CIVITAI_TOKEN (read at start-up)."""
        if self.civitai_token_file is not None:
            return self.civitai_token_file.read_text().strip().splitlines()[0].strip() or None
        return os.environ.get("CIVITAI_TOKEN") or None
