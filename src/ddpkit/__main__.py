"""`python -m ddpkit` is the `ddpkit` console script."""

from ddpkit.cli import main

if __name__ == "__main__":
    main()
