"""The errors an operator sees: each message is a single line, printed by the CLI as
`palisade-agent: error: <message>` with a non-zero exit status, never as a traceback."""

EXIT_ERROR = 1
EXIT_ENROL = 3  # nothing will work until this host is enrolled (again): systemd need not retry


class AgentError(Exception):
    exit_code = EXIT_ERROR

    def __init__(self, message: str) -> None:
        # A multi-line message (say, an OS error quoting a file) would break the one-line promise.
        self.message = " ".join(str(message).split())
        super().__init__(self.message)


class EnrolmentNeeded(AgentError):
    """Not enrolled, or the control plane refuses the credential for good (4403)."""

    exit_code = EXIT_ENROL


class GatewayUnreachable(AgentError):
    """No connection to one gateway (refused, timed out, no route): the next in the list is tried."""
