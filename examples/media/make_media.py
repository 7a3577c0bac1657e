"""Make the examples' media fixtures here, from code: nothing is downloaded.

- ``shapes.png``: a 96x64 picture of a red circle and a blue square on white (Pillow);
- ``tone.wav``: 0.5 s of a 440 Hz tone, 16 kHz mono 16-bit PCM (the standard library's ``wave``);
- ``clip.mp4``: 8 frames, 64x64, a white square crossing a dark background at 4 fps (OpenCV's
  ``mp4v`` writer, from ``opencv-python-headless``, which vLLM also uses to read video). Without
  OpenCV the frames are written as ``clip_frame_N.png`` instead and ``clip.mp4`` is skipped.

The examples call ``make_all()`` themselves when a file is missing.

    python examples/media/make_media.py
"""

from __future__ import annotations

import math
import struct
import wave
from pathlib import Path
from typing import BinaryIO

HERE = Path(__file__).resolve().parent


def make_png(path: Path) -> Path:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (96, 64), "white")
    draw = ImageDraw.Draw(img)
    draw.ellipse((8, 12, 48, 52), fill=(220, 30, 30))
    draw.rectangle((56, 16, 88, 48), fill=(30, 60, 220))
    img.save(path, "PNG")
    return path


def make_wav(path: Path | BinaryIO, seconds: float = 0.5, rate: int = 16000, hz: float = 440.0) -> Path | BinaryIO:
    """A sine tone as 16-bit mono PCM WAV, to a file or an open binary stream."""
    n = int(seconds * rate)
    samples = (int(12000 * math.sin(2 * math.pi * hz * i / rate)) for i in range(n))
    with wave.open(str(path) if isinstance(path, Path) else path, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"".join(struct.pack("<h", s) for s in samples))
    return path


def frames(count: int = 8, size: int = 64):
    """RGB frames (numpy arrays) of a white square moving left to right."""
    import numpy as np

    out = []
    for i in range(count):
        f = np.full((size, size, 3), 30, dtype=np.uint8)
        x = 4 + i * (size - 20) // max(1, count - 1)
        f[22:38, x:x + 16] = 255
        out.append(f)
    return out


def make_mp4(path: Path, fps: int = 4) -> Path | None:
    try:
        import cv2
    except ImportError:
        from PIL import Image

        for i, f in enumerate(frames()):
            Image.fromarray(f).save(path.with_name(f"clip_frame_{i}.png"))
        return None
    fs = frames()
    h, w = fs[0].shape[:2]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (w, h))
    for f in fs:
        writer.write(cv2.cvtColor(f, cv2.COLOR_RGB2BGR))
    writer.release()
    return path


def make_all(folder: Path = HERE) -> dict[str, Path | None]:
    folder.mkdir(parents=True, exist_ok=True)
    return {"png": make_png(folder / "shapes.png"), "wav": make_wav(folder / "tone.wav"),
            "mp4": make_mp4(folder / "clip.mp4")}


if __name__ == "__main__":
    for kind, path in make_all().items():
        print(f"{kind}: {path if path is None else f'{path} ({path.stat().st_size} bytes)'}")
