"""strata._picture: the PNG writer, the canvas and its font, and the picture
of a pipeline schedule. Every PNG is read back with the small decoder below
(signature, chunk CRCs, IHDR, inflated IDAT, filter bytes), and expected box
positions come from the renderer's own Layout, never from pasted pixels."""

import os
import struct
import zlib
from collections import Counter

import pytest

from strata import pipeline
from strata import _picture as pic

SIGNATURE = b"\x89PNG\r\n\x1a\n"


class Png:
    def __init__(self, width, height, pixels, kinds):
        self.width, self.height, self.pixels, self.kinds = width, height, pixels, kinds

    def get(self, x, y):
        i = (y * self.width + x) * 3
        return tuple(self.pixels[i:i + 3])

    def region(self, x0, y0, x1, y1):
        return Counter(self.get(x, y) for y in range(y0, y1) for x in range(x0, x1))


def read_png(path):
    """Decodes an 8-bit RGB PNG, checking what the format requires."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == SIGNATURE
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert len(body) == length, f"chunk {kind} is cut short"
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF, f"bad CRC in chunk {kind}"
        chunks.append((kind, body))
        pos += 12 + length
    assert pos == len(data)
    kinds = [k for k, _ in chunks]
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and b"IDAT" in kinds
    width, height, depth, color, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color, comp, filt, interlace) == (8, 2, 0, 0, 0)
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    stride = 3 * width
    assert len(raw) == height * (1 + stride)
    pixels = bytearray()
    for y in range(height):
        line = raw[y * (1 + stride):(y + 1) * (1 + stride)]
        assert line[0] == 0, f"row {y} has filter type {line[0]}; the writer uses none (0)"
        pixels += line[1:]
    return Png(width, height, bytes(pixels), kinds)


def rows_of(schedule, result):
    return [[(token, start, end) for token, (start, end) in
             zip(schedule.actions(r), result.timeline[r])] for r in range(schedule.num_ranks)]


def leftovers(folder):
    return [n for n in os.listdir(folder) if n.endswith(".tmp")]


# --- PNG writer --------------------------------------------------------------


def test_png_round_trip(tmp_path):
    w, h = 37, 11  # odd sizes: no row padding may creep in
    pixels = bytearray((x * 7 + y * 13 + c * 101) % 256 for y in range(h) for x in range(w)
                       for c in range(3))
    path = tmp_path / "a.png"
    assert pic.write_png(path, w, h, pixels) == path
    img = read_png(path)
    assert (img.width, img.height) == (w, h)
    assert img.pixels == bytes(pixels)
    assert img.kinds == [b"IHDR", b"IDAT", b"IEND"]
    assert leftovers(tmp_path) == []


def test_png_replaces_whole_files_and_honours_the_umask(tmp_path):
    path = str(tmp_path / "b.png")
    pic.write_png(path, 2, 1, bytearray([255, 0, 0, 0, 255, 0]))
    old = os.umask(0o027)
    try:
        pic.write_png(path, 1, 2, bytearray([0, 0, 255, 9, 9, 9]))
    finally:
        os.umask(old)
    img = read_png(path)
    assert (img.width, img.height, img.get(0, 1)) == (1, 2, (9, 9, 9))
    assert os.stat(path).st_mode & 0o777 == 0o640
    assert leftovers(tmp_path) == []


def test_png_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "c.png"
    pic.write_png(path, 1, 1, bytearray([1, 2, 3]))
    before = path.read_bytes()

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(pic.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        pic.write_png(path, 1, 1, bytearray([4, 5, 6]))
    assert path.read_bytes() == before
    assert leftovers(tmp_path) == []


def test_png_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match=r"2x2 RGB image has 12 bytes of pixels, got 11"):
        pic.write_png(tmp_path / "d.png", 2, 2, bytearray(11))
    with pytest.raises(ValueError, match=r"width must be an integer .* got 0"):
        pic.write_png(tmp_path / "d.png", 0, 2, bytearray())
    with pytest.raises(ValueError, match=r"height must be an integer .* got 1.5"):
        pic.write_png(tmp_path / "d.png", 2, 1.5, bytearray(9))
    assert os.listdir(tmp_path) == []
    with pytest.raises(FileNotFoundError):
        pic.write_png(tmp_path / "missing" / "d.png", 1, 1, bytearray(3))


# --- Canvas and font ---------------------------------------------------------


def ink(canvas, rgb):
    return sum(1 for y in range(canvas.height) for x in range(canvas.width)
               if canvas.get(x, y) == rgb)


def glyph_ink(ch):
    return pic._GLYPH_ROWS[ch].count("#")


def test_font_covers_what_the_pictures_need():
    needed = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ .:-/()%=,x"
    missing = [ch for ch in needed if ch not in pic.FONT]
    assert missing == []
    glyphs = [pic.FONT[ch] for ch in needed]
    # Every glyph is drawn (the space excepted) and no two look the same.
    assert [ch for ch, g in zip(needed, glyphs) if not g and ch != " "] == []
    assert len(set(glyphs)) == len(glyphs)


@pytest.mark.parametrize("scale", [1, 3])
def test_text_draws_the_glyphs(scale):
    c = pic.Canvas(40, 30)
    red = (200, 0, 0)
    assert c.text(2, 2, "8", red, scale=scale) == pic.text_width("8", scale) == 5 * scale
    eight = ink(c, red)
    c = pic.Canvas(40, 30)
    c.text(2, 2, "1", red, scale=scale)
    one = ink(c, red)
    assert eight > one > 0
    assert (eight, one) == (glyph_ink("8") * scale**2, glyph_ink("1") * scale**2)


def test_text_lowercase_unknown_and_clipping():
    lower, upper = pic.Canvas(20, 10), pic.Canvas(20, 10)
    lower.text(1, 1, "k", pic.INK)
    upper.text(1, 1, "K", pic.INK)
    assert lower.pixels == upper.pixels
    box = pic.Canvas(20, 10)
    box.text(1, 1, "\u00e9", pic.INK)  # not in the font: a filled 5x7 box
    assert ink(box, pic.INK) == 35
    assert {box.get(x, y) for x in range(1, 6) for y in range(1, 8)} == {pic.INK}
    edge = pic.Canvas(8, 8)
    edge.text(-3, 4, "MW\u2603", pic.INK, scale=2)  # partly outside: clipped, no error
    edge.text(100, 100, "0", pic.INK)
    assert 0 < ink(edge, pic.INK) < 64
    # Two glyphs are one advance apart: "11" is twice "1", shifted.
    c = pic.Canvas(20, 10)
    c.text(0, 0, "11", pic.INK)
    assert ink(c, pic.INK) == 2 * glyph_ink("1")
    assert c.get(2 + pic.GLYPH_ADVANCE, 0) == c.get(2, 0) == pic.INK


def test_rectangles_are_half_open_and_clipped():
    c = pic.Canvas(10, 6, background=(0, 0, 0))
    c.fill_rect(-5, 4, 3, 99, (1, 1, 1))
    assert ink(c, (1, 1, 1)) == 3 * 2
    c = pic.Canvas(10, 6, background=(0, 0, 0))
    c.rect_outline(1, 1, 6, 5, (2, 2, 2))
    assert ink(c, (2, 2, 2)) == 2 * 5 + 2 * 2
    assert c.get(1, 1) == c.get(5, 4) == (2, 2, 2)
    assert c.get(2, 2) == c.get(6, 4) == (0, 0, 0)


# --- Schedule pictures -------------------------------------------------------


def render(tmp_path, rows, name="s.png", **kwargs):
    path = tmp_path / name
    assert pic.render_schedule_png(rows, path, **kwargs) == path
    return read_png(path), pic._layout(rows, **kwargs)


def check_every_box(img, lay):
    """Each compute box shows its color just inside its outline; the time
    before the first box and in each gap of a rank is idle."""
    for r, row in enumerate(lay.ranks):
        _, y0, _, y1 = lay.box(r, row[0])
        ym = (y0 + y1) // 2
        free_from = lay.plot_x0
        for a in sorted(row, key=lambda a: a.start):
            x0, _, x1, _ = lay.box(r, a)
            if x1 - x0 >= 6:
                assert img.get(x0 + 2, ym) == lay.color(r, a), (r, a)
            if (a.end - a.start) * lay.scale >= 6:
                assert img.get(x0, ym) == pic._outline_color(lay.color(r, a)), (r, a)
            if x0 - free_from >= 3:
                assert img.get((free_from + x0) // 2, ym) == pic.IDLE, (r, a)
            free_from = x1
        assert free_from <= lay.plot_x1


def test_1f1b_boxes_idle_and_labels(tmp_path):
    s = pipeline.generate("1f1b", num_ranks=2, num_microbatches=3)
    result = pipeline.simulate(s)
    rows = rows_of(s, result)
    img, lay = render(tmp_path, rows, title=s.name, unit="steps")
    assert (img.width, img.height) == (lay.width, lay.height)
    # SEND/RECV are not drawn; every compute action is, in order.
    assert [[a.token for a in row] for row in lay.ranks] == [
        [t for t in s.actions(r) if "SEND" not in t and "RECV" not in t] for r in range(2)]

    f0 = lay.find(0, "0F0")
    x0, y0, x1, y1 = lay.box(0, f0)
    assert x1 - x0 >= pic.MIN_BOX
    forward = pic.KIND_COLORS["F"]
    assert lay.color(0, f0) == forward
    inside = img.region(x0 + 1, y0 + 1, x1 - 1, y1 - 1)
    assert inside.most_common(1)[0][0] == forward
    # The rest of the box is its microbatch label, "0".
    label = pic.label_color(forward)
    assert set(inside) == {forward, label}
    scale = round((inside[label] / glyph_ink("0")) ** 0.5)
    assert scale in (1, 2) and inside[label] == glyph_ink("0") * scale**2

    b0 = lay.find(1, "1B0")
    bx0, by0, bx1, by1 = lay.box(1, b0)
    assert img.region(bx0 + 1, by0 + 1, bx1 - 1, by1 - 1).most_common(1)[0][0] == \
        pic.KIND_COLORS["B"]
    assert img.get(bx0 + 2, (by0 + by1) // 2) == pic.KIND_COLORS["B"]
    # Rank 1 waits for its first forward until t=1.
    assert result.timeline[1][s.actions(1).index("1F0")][0] > 0.5
    assert img.get(lay.x(0.5), (by0 + by1) // 2) == pic.IDLE
    assert img.get(lay.x(0.5), by0 - 2) == pic.BACKGROUND  # between the bands
    check_every_box(img, lay)
    assert lay.bubble == pytest.approx(result.bubble_fraction, abs=1e-12)
    assert lay.x(0) == lay.plot_x0 and lay.x(result.makespan) == lay.plot_x1
    # The time axis starts with a tick at t=0.
    assert img.get(lay.x(0), lay.axis_y + 3) == pic.INK
    # The legend shows the kinds this schedule has, in their colors.
    assert [k for *_, k in lay.legend] == ["F", "B"]
    for x, y, _, kind in lay.legend:
        assert img.get(x + 5, y + 5) == pic.KIND_COLORS[kind]


def test_communication_does_not_change_the_picture(tmp_path):
    s = pipeline.generate("1f1b", num_ranks=3, num_microbatches=4)
    rows = rows_of(s, pipeline.simulate(s))
    compute = [[t for t in row if "SEND" not in t[0] and "RECV" not in t[0]] for row in rows]
    assert compute != rows
    with_comm, _ = render(tmp_path, rows, "a.png", title="x")
    without, _ = render(tmp_path, compute, "b.png", title="x")
    assert with_comm.pixels == without.pixels


@pytest.mark.parametrize("kind,extra", [("interleaved-1f1b", {"virtual_stages": 2}),
                                        ("zb-h1", {}), ("gpipe", {})])
def test_generated_schedules(tmp_path, kind, extra):
    s = pipeline.generate(kind, num_ranks=4, num_microbatches=8, **extra)
    result = pipeline.simulate(s)
    img, lay = render(tmp_path, rows_of(s, result), title=s.name, unit="steps")
    check_every_box(img, lay)
    assert lay.bubble == pytest.approx(result.bubble_fraction, abs=1e-12)
    assert img.width <= pic.MAX_WIDTH
    kinds = {a.kind for row in lay.ranks for a in row}
    assert [k for *_, k in lay.legend if k] == [k for k in "FBIW" if k in kinds]
    if kind == "interleaved-1f1b":
        # Rank 0 holds stages 0 and 4: its second stage is a darker shade.
        assert lay.stages[0] == [0, 4] and lay.num_shades == 2
        first, second = lay.find(0, "0F0"), lay.find(0, "4F0")
        assert lay.color(0, first) == pic.box_color("F", 0, 2) == pic.KIND_COLORS["F"]
        assert lay.color(0, second) == pic.box_color("F", 1, 2)
        assert sum(lay.color(0, second)) < sum(lay.color(0, first))
        assert lay.legend[-1][3] is None  # the line explaining the shades
    else:
        assert lay.num_shades == 1


def test_long_schedules_stay_within_the_width(tmp_path):
    s = pipeline.generate("1f1b", num_ranks=4, num_microbatches=200)
    img, lay = render(tmp_path, rows_of(s, pipeline.simulate(s)), unit="steps")
    assert img.width == lay.width <= pic.MAX_WIDTH
    narrow, _ = render(tmp_path, rows_of(s, pipeline.simulate(s)), "n.png", max_width=700)
    assert narrow.width <= 700
    check_every_box(img, lay)


def test_measured_seconds_and_units(tmp_path):
    rows = [[("0F0", 0.0, 0.010), ("0B0", 0.030, 0.052)],
            [("1F0", 0.011, 0.020), ("1B0", 0.020, 0.029)]]
    img, lay = render(tmp_path, rows, title="measured step")
    assert (lay.factor, lay.shown_unit) == (1e3, "ms")
    assert "MAKESPAN 52 ms" in lay.subtitle
    check_every_box(img, lay)
    assert lay.bubble == pytest.approx([1 - 0.032 / 0.052, 1 - 0.018 / 0.052])
    assert pic._layout(rows, unit="steps").shown_unit == "steps"
    assert pic._layout([[("0F0", 0, 2.5)]]).shown_unit == "s"
    assert pic._layout([[("0F0", 0, 2e-4)]]).shown_unit == "us"


@pytest.mark.parametrize("rows,message", [
    ([], "rows is empty"),
    ([[], []], "no compute actions in any of the 2 ranks"),
    ([[("0SEND_F0>1", 0, 1)], [("1RECV_F0<0", 0, 1)]], "no compute actions"),
    ([[("0F0", 0, 0), ("0B0", 0, 0)]], "total time is zero: all 2 compute actions end at t=0"),
    ([[("0X1", 0, 1)]], "rank 0 item 0: '0X1' is neither a compute token"),
    ([[("0F0", 0, 1)], [("1F0", 2, 1)]],
     "rank 1 1F0: needs 0 <= start <= end .* start=2.0 end=1.0"),
    ([[("0F0", -1, 1)]], "start=-1.0"),
    ([[("0F0", 0, float("nan"))]], "end=nan"),
    ([[("0F0", 0, "soon")]], "start and end must be numbers, got 0 and 'soon'"),
    ([[("0F0", 0)]], r"rank 0 item 0 is \('0F0', 0\), not a \(token, start, end\) triple"),
    ("0F0 0B0", "rows must be a list"),
])
def test_errors_name_the_problem(tmp_path, rows, message):
    path = tmp_path / "e.png"
    with pytest.raises(ValueError, match=message):
        pic.render_schedule_png(rows, path)
    assert not path.exists() and leftovers(tmp_path) == []


def data(path):
    with open(path, "rb") as f:
        return f.read()


def test_pipeline_save_picture_draws_the_simulated_or_given_step(tmp_path):
    # strata.pipeline.save_picture: by default the schedule simulated with
    # the given costs, in cost units; with rows=, what was measured.
    s = pipeline.generate("1f1b", num_ranks=3, num_microbatches=5)
    got = pipeline.save_picture(s, tmp_path / "a.png", backward=2.0)
    want = pic.render_schedule_png(rows_of(s, s.simulate(backward=2.0)), str(tmp_path / "b.png"),
                                   title=s.name, unit="steps")
    assert got == str(tmp_path / "a.png")
    assert read_png(got).width > 0 and data(got) == data(want)
    measured = [[(tok, a * 0.01, b * 0.01) for tok, a, b in row]
                for row in rows_of(s, s.simulate())]
    m = pipeline.save_picture(s, tmp_path / "m.png", rows=measured, title="measured")
    assert data(m) == data(pic.render_schedule_png(measured, str(tmp_path / "n.png"),
                                                   title="measured", unit="s"))
    assert data(m) != data(got)
