"""Video job ids carry the time their job was made: a list's cursor is placed by its id alone,
its job gone; an id made before ids carried a time (random throughout) is no cursor once its
job is gone."""

from loraswap.server.videos.ids import created_ms, cursor_key, is_video_id, new_video_id, sort_key

NOW = 1_750_000_000.0


def test_an_id_carries_its_jobs_creation_time_and_sorts_as_its_job_does():
    times = [NOW - 3600, NOW - 0.0015, NOW - 0.001, NOW]
    ids = [new_video_id(t) for t in times]
    assert all(is_video_id(video_id) for video_id in ids) and len(set(ids)) == 4
    assert [cursor_key(video_id, NOW) for video_id in ids] == [sort_key(i, t) for i, t in zip(ids, times)]
    assert [created_ms(t) for t in times] == [int(video_id[6:18], 16) for video_id in ids]
    assert len({new_video_id(NOW)[18:] for _ in range(100)}) == 100, "the rest is random"


def test_a_text_that_carries_no_time_places_no_cursor():
    for text in ("video_nope", "video_" + "0" * 32, "video_" + "f" * 32, new_video_id(NOW + 2 * 86400), 42):
        assert cursor_key(text, NOW) is None, text
    assert cursor_key(new_video_id(NOW + 3600), NOW) is not None, "a clock set back an hour since: still placed"
