"""``python -m minifloat ...`` (also ``torchrun -m minifloat train ...``): the command line."""

from minifloat.train.cli import main

__all__: list[str] = []

if __name__ == "__main__":
    raise SystemExit(main())
