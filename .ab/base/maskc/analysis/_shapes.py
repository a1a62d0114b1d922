"""Shape arithmetic for the analysis."""


def broadcast(*shapes) -> tuple:
    """torch.broadcast_shapes for the plain int shapes of analysis; torch's runs Python
    machinery for symbolic shapes that costs more than the arithmetic it guards here."""
    rank = max(len(s) for s in shapes)
    out = [1] * rank
    for shape in shapes:
        for i, n in enumerate(shape, rank - len(shape)):
            if n != 1:
                if out[i] not in (1, n):
                    raise ValueError(f"shapes {shapes} do not broadcast")
                out[i] = n
    return tuple(out)
