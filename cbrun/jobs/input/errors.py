"""The input error every input reader raises (``cbrun.jobs.input.reader`` and the modules it uses import it from here)."""


class InputError(ValueError):
    """The input cannot be read as asked (missing file or column, wrong column type); raised before any work."""
