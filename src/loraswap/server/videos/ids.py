"""Video job ids: `video_` and 32 hex digits, checked (`is_video_id`) before an id names a file.

The first 12 digits are the time the job was made, in milliseconds (Unix time, as the job's
`created_at`), the other 20 random (80 bits: an id is not guessed). So an id says where it
sorts among the jobs (`sort_key`: creation time, then id), even once its job is gone: a list's
`after` cursor whose job expired or was deleted between two pages still places the next page
(`cursor_key`). An id made before ids carried a time is random throughout: it places a page
while its job is kept (found among the jobs), and not after.
"""

import re
import secrets

VIDEO_ID = re.compile(r"video_[0-9a-f]{32}")  # what `new_video_id` makes; nothing else names a job
_TIME_DIGITS = 12  # 48 bits of milliseconds: past the year 10000
# the earliest time an id carrying one may say (2024-01-01): an older id's random digits
# rarely (a few in 10,000) fall between it and now
_EARLIEST_MS = 1_704_067_200_000
_SKEW_MS = 24 * 3600 * 1000  # a clock set back since an id was made: a day of slack


def created_ms(created_at: float) -> int:
    """A creation time (Unix seconds) as the milliseconds an id carries."""
    return int(created_at * 1000)


def new_video_id(created_at: float) -> str:
    """The id of a job made at `created_at` (Unix seconds, the job's own `created_at`)."""
    stamp = created_ms(created_at) % 16**_TIME_DIGITS
    return f"video_{stamp:0{_TIME_DIGITS}x}{secrets.token_hex((32 - _TIME_DIGITS) // 2)}"


def is_video_id(text: object) -> bool:
    """Whether `text` is a job id: checked before an id names a file."""
    return isinstance(text, str) and VIDEO_ID.fullmatch(text) is not None


def sort_key(video_id: str, created_at: float) -> tuple[int, str]:
    """Where a job sorts among the others: by creation time, then id."""
    return created_ms(created_at), video_id


def cursor_key(video_id: str, now: float) -> tuple[int, str] | None:
    """Where the job `video_id` sorted, from the id alone (its job gone); None for a text that
    is no id, or an id carrying no time (made before ids carried one)."""
    if not is_video_id(video_id):
        return None
    stamp = int(video_id[6:6 + _TIME_DIGITS], 16)
    if not _EARLIEST_MS <= stamp <= created_ms(now) + _SKEW_MS:
        return None
    return stamp, video_id
