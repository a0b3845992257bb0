"""Process-level metrics: GPU memory, as --max-gpu-memory-gb budgets it."""


def test_gpu_memory_gauges_follow_torchs_allocator(monkeypatch):
    import torch

    from loraswap.server.metrics import EngineFigures, Metrics

    assert b"loraswap_gpu_memory" not in Metrics().render(EngineFigures()) or torch.cuda.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i: 1000 * (i + 1))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda i: 5000 * (i + 1))
    text = Metrics().render(EngineFigures()).decode()
    assert 'loraswap_gpu_memory_bytes{device="1"} 2000.0' in text
    assert 'loraswap_gpu_memory_peak_bytes{device="0"} 5000.0' in text


def test_metrics_report_the_url_book_held_and_kept(tmp_path):
    """The app's URLs behind `url:` ids: how much of the book's bounds they take, and how many
    requests in flight hold (none once every request is answered)."""
    from fastapi.testclient import TestClient
    from support.fakes import fake_app

    from loraswap.server.url_book import url_bytes

    def figures(client) -> tuple[str, str, str]:
        lines = client.get("/metrics").text.splitlines()
        return tuple(next(line.split()[1] for line in lines if line.startswith(name + " "))
                     for name in ("loraswap_url_book_urls", "loraswap_url_book_bytes", "loraswap_url_book_held_urls"))

    kept, held = "https://cdn.example.com/a.safetensors?sig=1", "https://cdn.example.com/b.safetensors?sig=2"
    app, _ = fake_app(state_dir=tmp_path)
    with TestClient(app) as client:
        book = app.state.urls
        assert figures(client) == ("0.0", "0.0", "0.0")
        book.hold("url:a", kept)
        book.release("url:a", accepted=True)
        book.hold("url:b", held)
        assert figures(client) == ("2.0", f"{float(url_bytes(kept) + url_bytes(held))}", "1.0")
        book.release("url:b", accepted=False)
        assert figures(client) == ("1.0", f"{float(url_bytes(kept))}", "0.0")
