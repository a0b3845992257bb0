"""Write docs/settings.md from the settings (every `loraswap serve` flag, from the config classes).

    PYTHONPATH=src python tools/docs/settings_reference.py
"""

from pathlib import Path

from loraswap.cli.reference import settings_markdown

PAGE = Path(__file__).resolve().parents[2] / "docs" / "settings.md"

if __name__ == "__main__":
    PAGE.write_text(settings_markdown())
    print(f"wrote {PAGE}")
