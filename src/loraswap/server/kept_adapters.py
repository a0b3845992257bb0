"""The adapters an operator kept (`POST /adapters/{id}/load`), recorded in the state folder
so that a restart keeps them again.

One JSON list of ids (`kept-adapters.json`), written whole under a temporary name and
renamed, beside the video jobs' database (the folder `videos/state.py:VideoState` claims). At
start, once the backend serves, each recorded adapter is read and kept again in the
background (the store's own threads do the reading): `/ready` never waits for them. One
that cannot be kept any more (deleted, or now refused) is logged and dropped from the
record; an unreadable record is logged and started afresh.
"""

import json
import logging
import threading
from pathlib import Path

from loraswap.adapters.reference import AdapterRef
from loraswap.errors import LoraswapError
from loraswap.server.backend import until_served
from loraswap.server.state_files import read_plain_file, write_whole

logger = logging.getLogger("loraswap.server")

RECORD = "kept-adapters.json"
MAX_RECORD_BYTES = 16 * 2**20  # ids of at most a few hundred bytes each: far more than a server keeps


class KeptAdapters:
    def __init__(self, folder: Path):
        self.path = Path(folder) / RECORD
        self._lock = threading.Lock()
        self._ids = self._read()

    def ids(self) -> list[str]:
        with self._lock:
            return list(self._ids)

    def add(self, adapter_id: str) -> None:
        with self._lock:
            if adapter_id not in self._ids:
                self._ids.append(adapter_id)
                self._write()

    def remove(self, adapter_id: str) -> None:
        with self._lock:
            if adapter_id in self._ids:
                self._ids.remove(adapter_id)
                self._write()

    async def keep_again(self, backend) -> None:
        """Once `backend` serves, keep every recorded adapter again (a failed load: nothing)."""
        if not await until_served(backend):
            return
        for adapter_id in self.ids():
            try:
                await backend.keep_adapter(AdapterRef.of_id(adapter_id))  # (a URL's: from the download folder)
                logger.info("kept %s again, as before the restart", adapter_id)
            except LoraswapError as e:
                logger.warning("could not keep %s again after the restart: %s", adapter_id, e.message)
                self.remove(adapter_id)

    def _read(self) -> list[str]:
        try:
            ids = json.loads(read_plain_file(self.path, MAX_RECORD_BYTES))  # never through a link, nor a FIFO
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as e:
            logger.error("the record of kept adapters %s is unreadable (%s); starting afresh", self.path, e)
            return []
        if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
            logger.error("the record of kept adapters %s is not a list of ids; starting afresh", self.path)
            return []
        return ids

    def _write(self) -> None:
        data = json.dumps(self._ids).encode()
        try:
            write_whole(self.path, lambda f: f.write(data), sync=False)
        except OSError as e:  # a full disk: kept now, but not after a restart
            logger.error("could not record the kept adapters in %s: %s", self.path, e)
