"""mmwire.materialize: the owner side: resize plans, deferral, owner assignment, pixels -> features."""

from mmwire.transport._errors import MaterializeError as MaterializeError

__all__ = ["MaterializeError"]
