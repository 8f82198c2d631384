"""Rebuild data/austen.txt.xz, the corpus m3-tiny is trained on, from Debian's r-cran-janeaustenr package.

The package holds Jane Austen's six novels (public domain; the texts come from Project Gutenberg) as R
character vectors, one line of the printed book per element, inside R's lazy-load database
(data/Rdata.rdx + data/Rdata.rdb). R itself is not needed: the few object types the database uses are
decoded here. Each novel is then unwrapped into one paragraph per line, chapter headings and Gutenberg's
_italic_ marks dropped. See data/SOURCE.md for the provenance and licence.

    python scripts/make_m3_tiny_corpus.py            # apt-get download + extract + write data/austen.txt.xz
    python scripts/make_m3_tiny_corpus.py --deb X.deb
"""

import argparse
import gzip
import hashlib
import lzma
import re
import struct
import subprocess
import tempfile
import zlib
from pathlib import Path

DEB_NAME = "r-cran-janeaustenr"
DATA_DIR = "usr/lib/R/site-library/janeaustenr/data"
ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "data" / "austen.txt.xz"

# R serialization type codes (R Internals, "Serialization Formats") that this database uses.
NILVALUE, REF, SYM, LIST, CHAR, LGL, INT, REAL, STR, VEC = 254, 255, 1, 2, 9, 10, 13, 14, 16, 19
SINGLETONS = {253, 242, 241, 251, 247}  # global env, empty env, base env, missing arg, base namespace


class RUnserializer:
    """Reads the XDR ("X\\n") serialization of the vectors, pairlists and symbols an R data package stores."""

    def __init__(self, blob: bytes) -> None:
        if blob[:2] != b"X\n":
            raise ValueError("not an XDR R serialization")
        self.blob, self.pos, self.refs = blob, 2, []
        version = self._int()
        self._int(), self._int()  # writer's and minimal reader's R versions
        if version == 3:
            name_len = self._int()  # then the native encoding's name
            self.pos += name_len

    def _int(self) -> int:
        (value,) = struct.unpack_from(">i", self.blob, self.pos)
        self.pos += 4
        return value

    def read(self):
        flags = self._int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == NILVALUE or kind in SINGLETONS:
            return None
        if kind == REF:
            return self.refs[(flags >> 8 or self._int()) - 1]
        if kind == SYM:
            sym = ("symbol", self.read())
            self.refs.append(sym)
            return sym
        if kind == CHAR:
            n = self._int()
            if n == -1:
                return None  # NA_character_
            text = self.blob[self.pos : self.pos + n].decode("utf-8")
            self.pos += n
            return text
        if kind == LIST:  # pairlist: a dict from tag to value
            if has_attr:
                self.read()
            tag = self.read()[1] if has_tag else None
            head = {tag: self.read()}
            tail = self.read()
            return head | (tail or {})
        n = self._int()
        if kind in (STR, VEC):
            value = [self.read() for _ in range(n)]
        elif kind in (INT, LGL):
            value = list(struct.unpack_from(f">{n}i", self.blob, self.pos))
            self.pos += 4 * n
        elif kind == REAL:
            value = list(struct.unpack_from(f">{n}d", self.blob, self.pos))
            self.pos += 8 * n
        else:
            raise ValueError(f"R type {kind} is not handled")
        if has_attr:
            return {"value": value, "attributes": self.read()}
        return value


def read_lazyload_db(data_dir: Path) -> dict[str, list[str]]:
    """The objects of an R lazy-load database: an index (.rdx, gzip) of (offset, length) into .rdb, where
    each entry is a 4-byte length followed by a zlib stream of one serialized object."""
    index = RUnserializer(gzip.decompress((data_dir / "Rdata.rdx").read_bytes())).read()
    fields = dict(zip(index["attributes"]["names"], index["value"], strict=True))
    variables = fields["variables"]
    rdb = (data_dir / "Rdata.rdb").read_bytes()
    objects = {}
    for name, (offset, length) in zip(variables["attributes"]["names"], variables["value"], strict=True):
        entry = rdb[offset : offset + length]
        (size,) = struct.unpack(">i", entry[:4])
        blob = zlib.decompress(entry[4:])
        assert len(blob) == size, name
        objects[name] = RUnserializer(blob).read()
    return objects


HEADING = re.compile(r"^(CHAPTER|Chapter|VOLUME|Volume|ADVERTISEMENT|FINIS|THE END)\b|^[^a-z]*$")


def paragraphs(lines: list[str]) -> list[str]:
    """Unwrap hard-wrapped lines into paragraphs; drop headings, title lines and the italics underscores."""
    out, current = [], []
    for line in [*lines, ""]:
        line = (line or "").strip()
        if line:
            current.append(line)
            continue
        if current:
            text = re.sub(r"\s+", " ", " ".join(current)).replace("_", "")
            if not HEADING.match(text) and len(text.split()) > 3:
                out.append(text)
            current = []
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deb", type=Path, help="a downloaded r-cran-janeaustenr .deb (default: apt-get download)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        deb = args.deb
        if deb is None:
            subprocess.run(["apt-get", "download", DEB_NAME], cwd=tmp, check=True)
            deb = next(Path(tmp).glob(f"{DEB_NAME}_*.deb"))
        subprocess.run(["dpkg-deb", "-x", str(deb), f"{tmp}/root"], check=True)
        books = read_lazyload_db(Path(tmp) / "root" / DATA_DIR)
    # One novel after another, in the package's (alphabetical) order; a blank line between novels.
    text = "\n\n".join("\n".join(paragraphs(lines)) for _, lines in sorted(books.items())) + "\n"
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_bytes(lzma.compress(text.encode("utf-8"), preset=9 | lzma.PRESET_EXTREME))
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    print(f"{OUT.relative_to(ROOT)}: {len(text):,} chars, {len(text.split()):,} words, "
          f"{OUT.stat().st_size:,} bytes compressed, sha256 of the text {digest}")


if __name__ == "__main__":
    main()
