"""Byte encodings: manifest codec (msgpack), object codec, safetensors data-file headers."""
