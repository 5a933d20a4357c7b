"""Speculative decoding: n-gram and draft-model proposers, and the accept/resample rule."""
