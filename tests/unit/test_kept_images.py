"""The images kept for OpenAI's `response_format: "url"` (`server/images/kept.py`): one key's
files reach no other key, each is gone after its TTL (kept across a restart until then), all
of them stay under the byte cap (the oldest of the key holding the most dropped first), and a file is visible only once
whole."""

import asyncio
import errno
import os
import shutil
import stat

import pytest

from loraswap.server.images import kept as kept_images
from loraswap.server.images.kept import MEDIA_TYPES, ImageNotFound, ImageNotKept, KeptImages

OWNER, OTHER = "a" * 32, "b" * 32
TTL = 100.0


class Clock:
    def __init__(self, now: float = 1_700_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def files(folder) -> list[str]:
    """Every file under the images folder, as OWNER/NAME."""
    root = folder / "images"
    return sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file()) if root.exists() else []


def image(i: int, size: int = 100) -> bytes:
    return bytes([i % 256]) * size


def test_a_kept_image_is_its_owners_alone_and_written_private(tmp_path):
    kept = KeptImages(tmp_path, TTL, 2**20, Clock())
    name = kept.keep(image(1), "png", OWNER)
    assert len(name) == 36 and name.endswith(".png") and int(name[:32], 16) >= 0
    data, media, left = kept.read(name, OWNER)
    assert (data, media, left) == (image(1), "image/png", TTL)
    for owner in (OTHER, None):
        with pytest.raises(ImageNotFound):
            kept.read(name, owner)
    assert files(tmp_path) == [f"{OWNER}/{name}"], "no .part file left"
    assert stat.S_IMODE((tmp_path / "images" / OWNER / name).stat().st_mode) == 0o600
    open_name = kept.keep(image(2), "webp", None)  # a server without API keys: everyone's
    assert kept.read(open_name, None)[:2] == (image(2), MEDIA_TYPES["webp"])
    with pytest.raises(ImageNotFound):
        kept.read(open_name, OWNER)


@pytest.mark.parametrize("name", ["../" + "a" * 32 + ".png", "a" * 32 + ".gif", "A" * 32 + ".png", "x.png", "",
                                  "a" * 32 + ".png/..", "a" * 33 + ".png"])
def test_a_name_that_is_not_an_image_id_is_unknown(tmp_path, name):
    kept = KeptImages(tmp_path, TTL, 2**20, Clock())
    kept.keep(image(1), "png", OWNER)
    with pytest.raises(ImageNotFound):
        kept.read(name, OWNER)


def test_an_image_is_deleted_at_its_ttl_read_or_not(tmp_path):
    clock = Clock()
    kept = KeptImages(tmp_path, TTL, 2**20, clock)
    first = kept.keep(image(1), "png", OWNER)
    clock.now += TTL / 2
    second = kept.keep(image(2), "png", OWNER)
    clock.now += TTL / 2  # the first's TTL is up, the second's half
    with pytest.raises(ImageNotFound):
        kept.read(first, OWNER)
    assert files(tmp_path) == [f"{OWNER}/{second}"] and kept.kept_bytes() == 100
    assert kept.read(second, OWNER)[2] == TTL / 2
    clock.now += TTL / 2
    kept.sweep()  # what the app's lifespan runs every `sweep_interval_s` on an idle server
    assert files(tmp_path) == [] and kept.kept_bytes() == 0


def test_an_idle_server_sweeps_on_its_own(tmp_path):
    kept = KeptImages(tmp_path, 0.05, 2**20)
    kept.keep(image(1), "png", OWNER)

    async def idle():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(kept.sweep_every(), 0.3)

    asyncio.run(idle())
    assert files(tmp_path) == []


def test_the_oldest_images_go_first_past_the_byte_cap(tmp_path):
    clock = Clock()
    kept = KeptImages(tmp_path, TTL, 350, clock)
    names = []
    for i in range(5):
        clock.now += 1
        names.append(kept.keep(image(i), "png", OWNER if i % 2 else OTHER))
    assert kept.kept_bytes() == 300 and len(files(tmp_path)) == 3
    for gone in names[:2]:
        with pytest.raises(ImageNotFound):
            kept.read(gone, OTHER if names.index(gone) % 2 == 0 else OWNER)
    assert [kept.read(name, OWNER if i % 2 else OTHER)[0] for i, name in enumerate(names) if i >= 2] == \
        [image(2), image(3), image(4)]
    with pytest.raises(ImageNotKept) as refused:
        kept.keep(image(9, 351), "png", OWNER)
    assert refused.value.status == 507 and "b64_json" in refused.value.message
    assert kept.kept_bytes() == 300, "a refused image drops nothing"


def test_kept_images_survive_a_restart_until_their_ttl(tmp_path):
    clock = Clock()
    before = KeptImages(tmp_path, TTL, 2**20, clock)
    old = before.keep(image(1), "png", OWNER)
    clock.now += TTL / 2
    young = before.keep(image(2), "jpeg", OWNER)
    owner_folder = tmp_path / "images" / OWNER
    (owner_folder / ("c" * 32 + ".png.part")).write_bytes(b"half")  # a write a crash cut
    (owner_folder / "notes.txt").write_bytes(b"an operator's")  # no name of ours: left alone
    clock.now += TTL * 0.75
    after = KeptImages(tmp_path, TTL, 2**20, clock)  # the next start, the old image's TTL up
    assert after.read(young, OWNER) == (image(2), "image/jpeg", TTL / 4)
    with pytest.raises(ImageNotFound):
        after.read(old, OWNER)
    assert files(tmp_path) == sorted([f"{OWNER}/{young}", f"{OWNER}/notes.txt"])
    assert after.kept_bytes() == 100


def test_a_lower_cap_at_a_restart_drops_the_oldest(tmp_path):
    clock = Clock()
    before = KeptImages(tmp_path, TTL, 2**20, clock)
    names = []
    for i in range(3):
        clock.now += 1
        names.append(before.keep(image(i), "png", OWNER))
    after = KeptImages(tmp_path, TTL, 250, clock)
    assert [f.split("/")[1] for f in files(tmp_path)] == sorted(names[1:]) and after.kept_bytes() == 200


def test_links_are_never_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    state = tmp_path / "state"
    state.mkdir()
    (state / "images").symlink_to(elsewhere)
    with pytest.raises(ValueError, match="is a link"):
        KeptImages(state, TTL, 2**20)
    (state / "images").unlink()
    (state / "images").mkdir()
    (state / "images" / OWNER).symlink_to(elsewhere)
    kept = KeptImages(state, TTL, 2**20)
    with pytest.raises(ImageNotKept):
        kept.keep(image(1), "png", OWNER)
    assert list(elsewhere.iterdir()) == []
    secret = elsewhere / "secret"
    secret.write_bytes(b"not yours")
    os.unlink(state / "images" / OWNER)
    (state / "images" / OWNER).mkdir()
    (state / "images" / OWNER / ("d" * 32 + ".png")).symlink_to(secret)
    restarted = KeptImages(state, TTL, 2**20)
    with pytest.raises(ImageNotFound):
        restarted.read("d" * 32 + ".png", OWNER)


def test_a_full_disk_is_a_507_that_leaves_no_part_file(tmp_path, monkeypatch):
    kept = KeptImages(tmp_path, TTL, 2**20)

    def full(*args, **kwargs):  # after the .part file is written, before it is renamed
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kept_images.os, "utime", full)
    with pytest.raises(ImageNotKept) as refused:
        kept.keep(image(1), "png", OWNER)
    assert refused.value.status == 507 and kept.kept_bytes() == 0 and files(tmp_path) == []
    monkeypatch.undo()
    assert kept.read(kept.keep(image(2), "png", OWNER), OWNER)[0] == image(2), "it keeps working"


def test_one_keys_flood_deletes_its_own_images_before_another_keys(tmp_path):
    clock = Clock()
    kept = KeptImages(tmp_path, TTL, 500, clock)
    clock.now += 1
    others = [kept.keep(image(i), "png", OTHER) for i in range(2)]  # the oldest of all, unfetched
    flood = []
    for i in range(20):
        clock.now += 1
        flood.append(kept.keep(image(10 + i), "png", OWNER))
    assert [kept.read(name, OTHER)[0] for name in others] == [image(0), image(1)], "another key's images stay"
    assert [kept.read(name, OWNER)[0] for name in flood[-3:]] == [image(27), image(28), image(29)]
    with pytest.raises(ImageNotFound):
        kept.read(flood[-4], OWNER)
    assert kept.kept_bytes() == 500


def test_an_image_that_cannot_be_deleted_stays_listed_and_goes_at_a_later_sweep(tmp_path, monkeypatch):
    clock = Clock()
    kept = KeptImages(tmp_path, TTL, 2**20, clock)
    name = kept.keep(image(1), "png", OWNER)
    real = kept_images.Path.unlink

    def refused(path, missing_ok=False):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(kept_images.Path, "unlink", refused)
    clock.now += TTL + 1
    kept.sweep()
    assert kept.kept_bytes() == 100 and files(tmp_path) == [f"{OWNER}/{name}"], "listed while on disk"
    with pytest.raises(ImageNotFound):
        kept.read(name, OWNER)  # expired all the same
    monkeypatch.setattr(kept_images.Path, "unlink", real)
    kept.sweep()
    assert kept.kept_bytes() == 0 and files(tmp_path) == []


def test_an_entry_that_cannot_be_looked_at_is_skipped_at_a_start(tmp_path, monkeypatch, caplog):
    kept = KeptImages(tmp_path, TTL, 2**20)
    good, bad = kept.keep(image(1), "png", OWNER), kept.keep(image(2), "png", OWNER)
    real = kept_images.Path.stat

    def refused(path, *args, **kwargs):  # a file not the server's to read
        if path.name == bad:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(kept_images.Path, "stat", refused)
    restarted = KeptImages(tmp_path, TTL, 2**20)
    assert restarted.read(good, OWNER)[0] == image(1) and "left alone" in caplog.text


def test_a_folder_that_cannot_be_listed_stops_the_start_with_what_to_fix(tmp_path, monkeypatch):
    KeptImages(tmp_path, TTL, 2**20).keep(image(1), "png", OWNER)

    def unreadable(path):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(kept_images.Path, "iterdir", unreadable)
    with pytest.raises(ValueError, match="make it readable and writable"):
        KeptImages(tmp_path, TTL, 2**20)


def test_a_nearly_full_disk_is_refused_before_generating_and_discard_deletes(tmp_path, monkeypatch):
    kept = KeptImages(tmp_path, TTL, 2**20)
    kept.check_room()
    name = kept.keep(image(1), "png", OWNER)
    kept.discard(name, OWNER)
    assert files(tmp_path) == [] and kept.kept_bytes() == 0
    monkeypatch.setattr(kept_images.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**9, 10**9, 1000))
    with pytest.raises(ImageNotKept) as refused:
        kept.check_room()
    assert refused.value.status == 507 and "b64_json" in refused.value.message
    assert refused.value.headers == {"x-should-retry": "false"}
