"""The lean path's model families, one file each (a file may hold families that share everything but their
config tables, as ``llama.py`` holds Llama and Mistral); ``cbrun.engine.model.registry`` lists them."""
