"""Pipeline schedules as pictures: a PNG of which rank computes what, when.

Pure Python (zlib and struct only), so that drawing a schedule needs neither
matplotlib, PIL nor numpy. Three layers, each usable alone:

- :func:`write_png`: an RGB image (8 bits per channel) written atomically;
- :class:`Canvas`: rectangles and text in a built-in 5x7 bitmap font;
- :func:`render_schedule_png`: the picture of a pipeline step, one row per
  rank, from ``(token, start, end)`` triples as a simulation or a measured
  step gives them.

>>> from strata import pipeline
>>> from strata._picture import render_schedule_png
>>> s = pipeline.generate("1f1b", num_ranks=4, num_microbatches=8)
>>> r = s.simulate()
>>> rows = [[(token, start, end) for token, (start, end) in zip(s.actions(k), r.timeline[k])]
...         for k in range(s.num_ranks)]
>>> render_schedule_png(rows, "1f1b.png", title=s.name, unit="steps")
'1f1b.png'

Nothing here keeps state between calls; a Canvas is owned by its caller and
is not thread-safe.
"""

import math
import os
import re
import secrets
import struct
import zlib

# ---------------------------------------------------------------------------
# PNG


def write_png(path, width, height, pixels):
    """Writes ``pixels`` (``width * height * 3`` bytes, RGB, rows top to
    bottom) to ``path`` as an 8-bit RGB PNG and returns ``path``.

    The file appears whole or not at all: it is written to a temporary file
    in the same directory and renamed over ``path``."""
    for name, value in (("width", width), ("height", height)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 < value < 2**31:
            raise ValueError(f"PNG {name} must be an integer in [1, 2^31), got {value!r}")
    if len(pixels) != width * height * 3:
        raise ValueError(f"a {width}x{height} RGB image has {width * height * 3} bytes of "
                         f"pixels, got {len(pixels)}")
    stride = width * 3
    view = memoryview(pixels)
    # Filter type 0 (none) before each row: the deflate stream does the rest.
    raw = b"".join(b"\x00" + view[y * stride:(y + 1) * stride].tobytes() for y in range(height))

    def chunk(kind, data):
        return (struct.pack(">I", len(data)) + kind + data +
                struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, RGB, no interlace
    data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) +
            chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))

    target = os.fspath(path)
    folder, base = os.path.split(os.path.abspath(target))
    tmp = os.path.join(folder, f".{base}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    # os.open with 0o666 lets the umask decide the mode, as open() would.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


# ---------------------------------------------------------------------------
# Font: 5 columns x 7 rows per glyph, '#' = ink, rows top to bottom.

GLYPH_WIDTH = 5
GLYPH_HEIGHT = 7
GLYPH_ADVANCE = GLYPH_WIDTH + 1  # one column of space between glyphs

_GLYPH_ROWS = {
    "0": ".###. #...# #..## #.#.# ##..# #...# .###.",
    "1": "..#.. .##.. ..#.. ..#.. ..#.. ..#.. .###.",
    "2": ".###. #...# ....# ...#. ..#.. .#... #####",
    "3": "##### ...#. ..#.. ...#. ....# #...# .###.",
    "4": "...#. ..##. .#.#. #..#. ##### ...#. ...#.",
    "5": "##### #.... ####. ....# ....# #...# .###.",
    "6": "..##. .#... #.... ####. #...# #...# .###.",
    "7": "##### ....# ...#. ..#.. .#... .#... .#...",
    "8": ".###. #...# #...# .###. #...# #...# .###.",
    "9": ".###. #...# #...# .#### ....# ...#. .##..",
    "A": ".###. #...# #...# ##### #...# #...# #...#",
    "B": "####. #...# #...# ####. #...# #...# ####.",
    "C": ".###. #...# #.... #.... #.... #...# .###.",
    "D": "###.. #..#. #...# #...# #...# #..#. ###..",
    "E": "##### #.... #.... ####. #.... #.... #####",
    "F": "##### #.... #.... ####. #.... #.... #....",
    "G": ".###. #...# #.... #.### #...# #...# .####",
    "H": "#...# #...# #...# ##### #...# #...# #...#",
    "I": ".###. ..#.. ..#.. ..#.. ..#.. ..#.. .###.",
    "J": "..### ...#. ...#. ...#. ...#. #..#. .##..",
    "K": "#...# #..#. #.#.. ##... #.#.. #..#. #...#",
    "L": "#.... #.... #.... #.... #.... #.... #####",
    "M": "#...# ##.## #.#.# #.#.# #...# #...# #...#",
    "N": "#...# #...# ##..# #.#.# #..## #...# #...#",
    "O": ".###. #...# #...# #...# #...# #...# .###.",
    "P": "####. #...# #...# ####. #.... #.... #....",
    "Q": ".###. #...# #...# #...# #.#.# #..#. .##.#",
    "R": "####. #...# #...# ####. #.#.. #..#. #...#",
    "S": ".#### #.... #.... .###. ....# ....# ####.",
    "T": "##### ..#.. ..#.. ..#.. ..#.. ..#.. ..#..",
    "U": "#...# #...# #...# #...# #...# #...# .###.",
    "V": "#...# #...# #...# #...# #...# .#.#. ..#..",
    "W": "#...# #...# #...# #.#.# #.#.# #.#.# .#.#.",
    "X": "#...# #...# .#.#. ..#.. .#.#. #...# #...#",
    "Y": "#...# #...# .#.#. ..#.. ..#.. ..#.. ..#..",
    "Z": "##### ....# ...#. ..#.. .#... #.... #####",
    "x": "..... ..... #...# .#.#. ..#.. .#.#. #...#",
    " ": "..... ..... ..... ..... ..... ..... .....",
    ".": "..... ..... ..... ..... ..... .##.. .##..",
    ",": "..... ..... ..... ..... .##.. ..#.. .#...",
    ":": "..... .##.. .##.. ..... .##.. .##.. .....",
    "-": "..... ..... ..... ##### ..... ..... .....",
    "_": "..... ..... ..... ..... ..... ..... #####",
    "+": "..... ..#.. ..#.. ##### ..#.. ..#.. .....",
    "=": "..... ..... ##### ..... ##### ..... .....",
    "/": "..... ....# ...#. ..#.. .#... #.... .....",
    "%": "##... ##..# ...#. ..#.. .#... #..## ...##",
    "(": "...#. ..#.. .#... .#... .#... ..#.. ...#.",
    ")": ".#... ..#.. ...#. ...#. ...#. ..#.. .#...",
    "[": ".###. .#... .#... .#... .#... .#... .###.",
    "]": ".###. ...#. ...#. ...#. ...#. ...#. .###.",
    "<": "...#. ..#.. .#... #.... .#... ..#.. ...#.",
    ">": ".#... ..#.. ...#. ....# ...#. ..#.. .#...",
    "'": "..#.. ..#.. .#... ..... ..... ..... .....",
    "#": ".#.#. .#.#. ##### .#.#. ##### .#.#. .#.#.",
    "*": "..... ..#.. #.#.# .###. #.#.# ..#.. .....",
    "!": "..#.. ..#.. ..#.. ..#.. ..#.. ..... ..#..",
    "?": ".###. #...# ....# ...#. ..#.. ..... ..#..",
}


def _compile_font(table):
    font = {}
    for ch, spec in table.items():
        rows = spec.split()
        # A broken table is a bug in this file, not a user error.
        assert len(rows) == GLYPH_HEIGHT and all(len(r) == GLYPH_WIDTH for r in rows), ch
        font[ch] = tuple((x, y) for y, r in enumerate(rows) for x, c in enumerate(r) if c == "#")
    return font


# Each glyph as the (column, row) of its ink pixels.
FONT = _compile_font(_GLYPH_ROWS)
# What a character the font lacks looks like: a filled box.
UNKNOWN_GLYPH = tuple((x, y) for y in range(GLYPH_HEIGHT) for x in range(GLYPH_WIDTH))


def glyph(ch):
    """The ink pixels of ``ch``: its own glyph, its uppercase one, or a box."""
    found = FONT.get(ch)
    if found is None:
        found = FONT.get(ch.upper(), UNKNOWN_GLYPH)
    return found


def text_width(s, scale=1):
    """Pixels from the left of ``s``'s first glyph to the right of its last."""
    return max(0, len(s) * GLYPH_ADVANCE - 1) * scale


# ---------------------------------------------------------------------------
# Canvas


class Canvas:
    """An RGB image in memory. Coordinates are pixels from the top left;
    rectangles are half-open (``x0 <= x < x1``, ``y0 <= y < y1``) and every
    drawing call clips to the image instead of raising."""

    def __init__(self, width, height, background=(255, 255, 255)):
        if width <= 0 or height <= 0:
            raise ValueError(f"a canvas needs a positive size, got {width}x{height}")
        self.width = int(width)
        self.height = int(height)
        self.pixels = bytearray(bytes(background) * (self.width * self.height))

    def get(self, x, y):
        """The (r, g, b) at (x, y)."""
        i = (y * self.width + x) * 3
        return tuple(self.pixels[i:i + 3])

    def fill_rect(self, x0, y0, x1, y1, rgb):
        """Paints ``[x0, x1) x [y0, y1)``."""
        x0, x1 = max(0, int(x0)), min(self.width, int(x1))
        y0, y1 = max(0, int(y0)), min(self.height, int(y1))
        if x0 >= x1 or y0 >= y1:
            return
        run = bytes(rgb) * (x1 - x0)
        for y in range(y0, y1):
            i = (y * self.width + x0) * 3
            self.pixels[i:i + len(run)] = run

    def rect_outline(self, x0, y0, x1, y1, rgb, thickness=1):
        """Paints the border of ``[x0, x1) x [y0, y1)``, ``thickness`` pixels
        wide, inside the rectangle."""
        t = thickness
        self.fill_rect(x0, y0, x1, min(y1, y0 + t), rgb)
        self.fill_rect(x0, max(y0, y1 - t), x1, y1, rgb)
        self.fill_rect(x0, y0, min(x1, x0 + t), y1, rgb)
        self.fill_rect(max(x0, x1 - t), y0, x1, y1, rgb)

    def text(self, x, y, s, rgb, scale=1):
        """Writes ``s`` with its top left at (x, y), each font pixel a
        ``scale`` x ``scale`` square; returns the width drawn (text_width)."""
        scale = max(1, int(scale))
        for i, ch in enumerate(str(s)):
            gx = x + i * GLYPH_ADVANCE * scale
            for px, py in glyph(ch):
                self.fill_rect(gx + px * scale, y + py * scale,
                               gx + (px + 1) * scale, y + (py + 1) * scale, rgb)
        return text_width(str(s), scale)

    def save(self, path):
        """write_png of this canvas; returns ``path``."""
        return write_png(path, self.width, self.height, self.pixels)


# ---------------------------------------------------------------------------
# Schedule picture

BACKGROUND = (255, 255, 255)
IDLE = (236, 236, 236)       # a rank's time with no compute
INK = (32, 32, 32)           # text and axis
KIND_COLORS = {
    "F": (70, 130, 220),     # forward: blue
    "B": (60, 160, 90),      # backward: green
    "I": (150, 95, 205),     # backward for the input: purple
    "W": (235, 145, 45),     # backward for the weights: orange
}
KIND_NAMES = {"F": "FORWARD", "B": "BACKWARD", "I": "BACKWARD INPUT", "W": "BACKWARD WEIGHT"}

MAX_WIDTH = 1200             # the whole image, unless max_width= says otherwise
MIN_BOX = 24                 # what the shortest compute action gets where it fits
MIN_PLOT = 480
MARGIN = 12
ROW_HEIGHT = 30
ROW_GAP = 8

_COMPUTE = re.compile(r"^(\d+)([FBIW])(\d+)$")


def box_color(kind, shade, num_shades):
    """The fill of a ``kind`` box on a rank holding ``num_shades`` stages,
    for the rank's ``shade``-th stage (0 = its lowest): the kind's color,
    darker for each later stage."""
    base = KIND_COLORS[kind]
    if num_shades <= 1:
        return base
    f = 1.0 - 0.4 * shade / (num_shades - 1)  # later stages down to 60% brightness
    return tuple(int(round(c * f)) for c in base)


def _outline_color(rgb):
    return tuple(int(c * 0.55) for c in rgb)


def label_color(rgb):
    """Black or white, whichever reads better on ``rgb``."""
    r, g, b = rgb
    return (0, 0, 0) if 0.299 * r + 0.587 * g + 0.114 * b > 150 else (255, 255, 255)


class Action:
    """One compute action of a row: ``token`` such as ``"0F3"``, its
    ``stage``, ``kind`` (F, B, I, W), ``microbatch``, ``start`` and ``end``."""

    __slots__ = ("token", "stage", "kind", "microbatch", "start", "end")

    def __init__(self, token, stage, kind, microbatch, start, end):
        self.token, self.stage, self.kind, self.microbatch = token, stage, kind, microbatch
        self.start, self.end = start, end

    def __repr__(self):
        return f"Action({self.token!r}, {self.start}, {self.end})"


def _parse_rows(rows):
    """The compute actions of each rank; SEND/RECV tokens are dropped."""
    if isinstance(rows, (str, bytes)) or not hasattr(rows, "__len__"):
        raise ValueError(f"rows must be a list with one list of (token, start, end) per rank, "
                         f"got {type(rows).__name__}")
    if len(rows) == 0:
        raise ValueError("rows is empty: a schedule picture needs at least one rank")
    parsed = []
    for r, row in enumerate(rows):
        actions = []
        for k, item in enumerate(row):
            try:
                token, start, end = item
            except (TypeError, ValueError):
                raise ValueError(f"rank {r} item {k} is {item!r}, not a (token, start, end) "
                                 "triple") from None
            token = str(token)
            if "SEND" in token or "RECV" in token:
                continue
            m = _COMPUTE.match(token)
            if m is None:
                raise ValueError(f"rank {r} item {k}: {token!r} is neither a compute token "
                                 "(<stage><F|B|I|W><microbatch>, e.g. '0F3') nor a SEND/RECV")
            try:
                start, end = float(start), float(end)
            except (TypeError, ValueError):
                raise ValueError(f"rank {r} {token}: start and end must be numbers, got "
                                 f"{start!r} and {end!r}") from None
            if not (math.isfinite(start) and math.isfinite(end)) or start < 0 or end < start:
                raise ValueError(f"rank {r} {token}: needs 0 <= start <= end (finite), got "
                                 f"start={start} end={end}")
            actions.append(Action(token, int(m.group(1)), m.group(2), int(m.group(3)),
                                  start, end))
        parsed.append(actions)
    if not any(parsed):
        raise ValueError(f"no compute actions in any of the {len(rows)} ranks' rows (empty, "
                         "or only SEND/RECV): nothing to draw")
    return parsed


def _busy(actions):
    """Time covered by at least one of ``actions``."""
    total, reach = 0.0, 0.0
    for a in sorted(actions, key=lambda a: a.start):
        if a.end > reach:
            total += a.end - max(a.start, reach)
            reach = a.end
    return total


def _time_unit(total, unit):
    """(factor, unit) to print times in: seconds below one become ms or us."""
    if unit == "s" and total < 1e-3:
        return 1e6, "us"
    if unit == "s" and total < 1:
        return 1e3, "ms"
    return 1.0, unit


def _nice_step(span, target):
    """A tick step of 1, 2 or 5 times a power of ten giving about ``target`` ticks."""
    raw = span / max(1, target)
    mag = 10.0 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if m * mag >= raw * (1 - 1e-9):
            return m * mag
    return 10 * mag


def _format(value, step):
    decimals = max(0, -int(math.floor(math.log10(step) + 1e-9)))
    return f"{value:.{decimals}f}"


def _format_total(value):
    return f"{value:.4g}"


class Layout:
    """Where everything of a schedule picture goes, computed before drawing
    (and by tests, to find a box). ``x(t)`` is the pixel column of time t;
    ``row_y(r)`` the pixel rows [y0, y1) of rank r's band."""

    def __init__(self, rows, *, title=None, unit="s", max_width=MAX_WIDTH):
        self.ranks = _parse_rows(rows)
        actions = [a for row in self.ranks for a in row]
        self.total = max(a.end for a in actions)
        if self.total <= 0:
            raise ValueError(f"the total time is zero: all {len(actions)} compute actions end at "
                             "t=0, so there is no time axis to draw")
        self.unit = unit
        self.title = "PIPELINE SCHEDULE" if title is None else str(title)
        self.num_microbatches = max(a.microbatch for a in actions) + 1
        # Each rank's stages, lowest first: the index of a stage is its shade.
        self.stages = [sorted({a.stage for a in row}) for row in self.ranks]
        self.num_shades = max(1, max(len(s) for s in self.stages))
        self.kinds = [k for k in KIND_COLORS if any(a.kind == k for a in actions)]
        self.bubble = [1.0 - _busy(row) / self.total for row in self.ranks]
        self.factor, self.shown_unit = _time_unit(self.total, unit)

        n = len(self.ranks)
        self.subtitle = (f"{n} RANK{'S' if n != 1 else ''}  {self.num_microbatches} MICROBATCH"
                         f"{'ES' if self.num_microbatches != 1 else ''}  MAKESPAN "
                         f"{_format_total(self.total * self.factor)} {self.shown_unit}")
        label_w = max(text_width(f"RANK {n - 1}", 2),
                      max(text_width(self._stage_label(s), 1) for s in self.stages))
        self.plot_x0 = MARGIN + label_w + MARGIN
        right = MARGIN + max(text_width("BUBBLE", 1), text_width("100.0%", 1)) + MARGIN
        shortest = min((a.end - a.start for a in actions if a.end > a.start), default=self.total)
        want = self.total / shortest * MIN_BOX
        room = max(MIN_PLOT, max_width - self.plot_x0 - right)
        self.plot_width = int(math.ceil(min(max(want, MIN_PLOT), room)))
        self.plot_x1 = self.plot_x0 + self.plot_width
        self.scale = self.plot_width / self.total  # pixels per unit of time
        self.width = self.plot_x1 + right
        header = max(text_width(self.title, 2), text_width(self.subtitle, 1)) + 2 * MARGIN
        self.width = max(self.width, min(max_width, header))

        self.title_y = MARGIN
        self.subtitle_y = self.title_y + 2 * GLYPH_HEIGHT + 6
        self.rows_y0 = self.subtitle_y + GLYPH_HEIGHT + 22
        self.axis_y = self.rows_y0 + n * (ROW_HEIGHT + ROW_GAP) - ROW_GAP + 4
        self.legend_y = self.axis_y + 6 + GLYPH_HEIGHT + 8 + GLYPH_HEIGHT + 16
        self.legend = self._legend_items()
        self.height = self.legend[-1][2] + 10 + MARGIN if self.legend else self.legend_y

    @staticmethod
    def _stage_label(stages):
        return ("STAGE " if len(stages) == 1 else "STAGES ") + ",".join(map(str, stages))

    def x(self, t):
        """The pixel column where time ``t`` begins."""
        return self.plot_x0 + int(round(t * self.scale))

    def row_y(self, r):
        """Pixel rows [y0, y1) of rank ``r``'s band."""
        y0 = self.rows_y0 + r * (ROW_HEIGHT + ROW_GAP)
        return y0, y0 + ROW_HEIGHT

    def box(self, rank, action):
        """[x0, x1) x [y0, y1) of rank ``rank``'s ``action``, at least 1 px wide."""
        y0, y1 = self.row_y(rank)
        x0 = self.x(action.start)
        return x0, y0, max(x0 + 1, self.x(action.end)), y1

    def find(self, rank, token):
        """Rank ``rank``'s compute action ``token`` (the first if repeated)."""
        for a in self.ranks[rank]:
            if a.token == token:
                return a
        raise KeyError(f"rank {rank} has no compute action {token!r}")

    def color(self, rank, action):
        """The fill of ``action``'s box on rank ``rank``."""
        return box_color(action.kind, self.stages[rank].index(action.stage), len(self.stages[rank]))

    def _legend_items(self):
        """(x, y, bottom, kind) of each legend entry, wrapped to the width."""
        items, x, y = [], MARGIN, self.legend_y
        swatch = 12 * self.num_shades + 2 * (self.num_shades - 1)
        for kind in self.kinds:
            w = swatch + 6 + text_width(f"{kind} {KIND_NAMES[kind]}", 1) + 24
            if x + w > self.width - MARGIN and x > MARGIN:
                x, y = MARGIN, y + 20
            items.append((x, y, y + 12, kind))
            x += w
        if self.num_shades > 1:
            x, y = MARGIN, y + 20
            items.append((x, y, y + 12, None))
        return items


def _draw(lay):
    c = Canvas(lay.width, lay.height, BACKGROUND)
    c.text(MARGIN, lay.title_y, lay.title, INK, scale=2)
    c.text(MARGIN, lay.subtitle_y, lay.subtitle, INK)
    c.text(lay.plot_x1 + MARGIN, lay.rows_y0 - GLYPH_HEIGHT - 6, "BUBBLE", INK)

    all_actions = [a for row in lay.ranks for a in row]
    # One label size for the whole picture: 2x where every box fits its label.
    widest = max(text_width(str(a.microbatch), 2) + 6 - (lay.x(a.end) - lay.x(a.start))
                 for a in all_actions)
    label_scale = 2 if widest <= 0 and ROW_HEIGHT >= 2 * GLYPH_HEIGHT + 6 else 1

    for r, row in enumerate(lay.ranks):
        y0, y1 = lay.row_y(r)
        label_y = y0 + (ROW_HEIGHT - 2 * GLYPH_HEIGHT - 3 - GLYPH_HEIGHT) // 2
        c.text(MARGIN, label_y, f"RANK {r}", INK, scale=2)
        c.text(MARGIN, label_y + 2 * GLYPH_HEIGHT + 3, lay._stage_label(lay.stages[r]), INK)
        c.fill_rect(lay.plot_x0, y0, lay.plot_x1, y1, IDLE)
        for a in row:
            x0, _, x1, _ = lay.box(r, a)
            fill = lay.color(r, a)
            c.fill_rect(x0, y0, x1, y1, fill)
            # Narrower boxes would be all outline. The exact width decides, not
            # the rounded one, so that equal actions look alike.
            if (a.end - a.start) * lay.scale >= 6:
                c.rect_outline(x0, y0, x1, y1, _outline_color(fill))
            label = str(a.microbatch)
            for scale in (label_scale, 1):
                w, h = text_width(label, scale), GLYPH_HEIGHT * scale
                if w + 6 <= x1 - x0 and h + 4 <= y1 - y0:
                    c.text(x0 + (x1 - x0 - w + 1) // 2, y0 + (y1 - y0 - h + 1) // 2, label,
                           label_color(fill), scale)
                    break
        pct = f"{100 * lay.bubble[r]:.1f}%"
        c.text(lay.plot_x1 + MARGIN, y0 + (ROW_HEIGHT - GLYPH_HEIGHT) // 2, pct, INK)

    # Time axis: a line under the rows, ticks at round values, the unit.
    ay = lay.axis_y
    c.fill_rect(lay.plot_x0, ay, lay.plot_x1 + 1, ay + 1, INK)
    shown = lay.total * lay.factor
    step = _nice_step(shown, max(2, lay.plot_width // 90))
    last_right = -1
    for i in range(int(math.floor(shown / step + 1e-9)) + 1):
        v = i * step
        px = lay.x(v / lay.factor)
        c.fill_rect(px, ay, px + 1, ay + 5, INK)
        s = _format(v, step)
        left = px - text_width(s) // 2
        if left > last_right + 4:
            c.text(left, ay + 8, s, INK)
            last_right = left + text_width(s)
    caption = f"TIME ({lay.shown_unit})"
    c.text(lay.plot_x0 + (lay.plot_width - text_width(caption)) // 2, ay + 8 + GLYPH_HEIGHT + 6,
           caption, INK)

    for x, y, _, kind in lay.legend:
        if kind is None:
            x += c.text(x, y + 2, "SHADES, LIGHT TO DARK: A RANK'S STAGES, LOWEST FIRST", INK)
            continue
        for s in range(lay.num_shades):
            fill = box_color(kind, s, lay.num_shades)
            c.fill_rect(x, y, x + 12, y + 12, fill)
            c.rect_outline(x, y, x + 12, y + 12, _outline_color(fill))
            x += 14
        c.text(x + 4, y + 2, f"{kind} {KIND_NAMES[kind]}", INK)
    return c


def render_schedule_png(rows, path, *, title=None, unit="s", max_width=MAX_WIDTH):
    """Draws one pipeline step to the PNG ``path`` and returns ``path``.

    ``rows[r]`` lists rank r's actions as ``(token, start, end)``: compute
    tokens ``<stage><F|B|I|W><microbatch>`` (``"0F3"``) become boxes colored
    by kind (a darker shade for each further stage a rank holds, as in
    interleaved schedules) and labeled with the microbatch where they fit;
    SEND/RECV tokens are skipped. ``start`` and ``end`` are in ``unit``
    (seconds are printed as ms or us when the step is short). The image is
    at most ``max_width`` pixels wide (wider only if that cannot hold the
    rank labels and a 480-pixel time axis). Raises ValueError when there is
    nothing to draw (no ranks, no compute actions, zero total time) or an
    item is malformed, naming it."""
    return _draw(Layout(rows, title=title, unit=unit, max_width=max_width)).save(path)


def _layout(rows, **kwargs):
    """The Layout render_schedule_png uses for these arguments."""
    return Layout(rows, **kwargs)
