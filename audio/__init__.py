"""Audio input: file decoding, PCM framing, resampling and Whisper log-mel features."""

from audio.container import load_audio
from audio.io import SAMPLE_RATE, AudioError, pcm_to_float, resample

__all__ = ["SAMPLE_RATE", "AudioError", "load_audio", "pcm_to_float", "resample"]
