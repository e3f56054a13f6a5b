"""What the handlers are given through FastAPI's dependencies: the service the app was built over (app.state), the
owner of the caller's key, and a list page's limit and shape."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Header, Request

from pipeline.server.api.errors import ApiError
from pipeline.server.schemas import ListPage
from pipeline.server.service import BatchService


async def get_service(request: Request) -> BatchService:
    """The app's service (routes.py attaches it to app.state)."""
    return request.app.state.service


# Module level, so FastAPI resolves them from the handlers' (postponed) annotations.
Service = Annotated[BatchService, Depends(get_service)]


def current_owner(service: Service, authorization: Annotated[str | None, Header()] = None) -> str:
    """The owner of the request's key; 401 in OpenAI's words without one."""
    found = service.keyring.owner(authorization)
    if found is None:
        message = (
            "Incorrect API key provided."
            if authorization
            else "You didn't provide an API key. Send it as 'Authorization: Bearer KEY'."
        )
        raise ApiError(401, message, code="invalid_api_key")
    return found


Owner = Annotated[str, Depends(current_owner)]


def page_limit(limit: int) -> int:
    if not 1 <= limit <= 100:
        raise ApiError(400, "limit must be between 1 and 100", param="limit")
    return limit


def list_page(data: list[Any], more: bool) -> ListPage:
    return ListPage(
        data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None, has_more=more
    )
