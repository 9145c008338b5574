"""User-facing errors: the CLI prints these as one message, without a traceback."""


class GymError(Exception):
    """A problem the user can fix (bad config, missing file, bad data row); the message says what to do."""


class ConfigError(GymError):
    """The YAML config is invalid; the message names the key, its line and what is allowed."""


class DataError(GymError):
    """A dataset file or row is unusable; the message names the file, the row and the field."""


class ModelError(GymError):
    """The base model cannot be located or loaded; the message says why and what to do."""


class HubPushError(GymError):
    """A push to the Hugging Face Hub failed after the run's files were saved: the message says why and gives the
    `gym push` command that retries it; the CLI exits with `exit_code`, not 2, so that a script can tell a run that
    trained but did not reach the Hub from one that failed."""

    exit_code = 3
