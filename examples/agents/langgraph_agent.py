"""The calculator task as a LangGraph agent: a graph of a model node (langchain-openai's ChatOpenAI
with the task's tools bound) and a tool node, looping until the model answers without a tool call.

    mtrl run --agent examples.agents.langgraph_agent:agent
"""

from __future__ import annotations

import json
from typing import Annotated, TypedDict

from langchain_core.messages import AnyMessage, SystemMessage, ToolMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

from stages.tools import TOOLS


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]


def run_tool(name: str, arguments: dict) -> str:
    try:
        return str(TOOLS[name](**arguments))
    except Exception as exc:  # the model reads the error and may try again
        return f"Error: {exc}"


async def agent(rollout) -> None:
    model = ChatOpenAI(model=rollout.model, base_url=rollout.base_url, api_key=rollout.api_key, max_retries=0)
    model = model.bind_tools(rollout.tools)  # the task's own schemas: the prompt the policy knows

    async def think(state: State) -> State:
        return {"messages": [await model.ainvoke(state["messages"])]}

    def act(state: State) -> State:
        calls = state["messages"][-1].tool_calls
        return {"messages": [ToolMessage(run_tool(c["name"], c["args"]), tool_call_id=c["id"]) for c in calls]}

    graph = StateGraph(State)
    graph.add_node("think", think)
    graph.add_node("act", act)
    graph.add_edge(START, "think")
    graph.add_conditional_edges("think", lambda state: "act" if state["messages"][-1].tool_calls else END)
    graph.add_edge("act", "think")
    system = next(m["content"] for m in rollout.messages if m["role"] == "system")
    question = next(m["content"] for m in rollout.messages if m["role"] == "user")
    start = {"messages": [SystemMessage(system), ("user", question)]}
    await graph.compile().ainvoke(start, config={"recursion_limit": 20})
    return None  # the task's reward of the final answer


__all__ = ["agent", "json"]
