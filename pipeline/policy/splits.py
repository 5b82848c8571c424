"""Each family's default training and held-out split: where demonstrations come from and where success is
measured (disjoint splits of each family). A module of its own so that the dispatcher and the evaluation
read them without the SFT trainer's imports (torch)."""

TRAIN_SPLITS = {"calc": "train", "db": "standard", "kg": "train", "os": "train",
                "webshop": "generated-train", "alfworld": "standard", "python": "train"}
EVAL_SPLITS = {"calc": "dev", "db": "dev", "kg": "dev", "os": "test", "webshop": "generated-dev", "alfworld": "dev",
               "python": "dev"}
