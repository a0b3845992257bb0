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
