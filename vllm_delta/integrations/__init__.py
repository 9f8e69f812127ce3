"""Drop-ins for RL frameworks: each module adapts one framework's weight sync to `DeltaSender`."""
