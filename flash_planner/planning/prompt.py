"""The planner's chat prompt: skills and plan format in the system message, the task after.

Kept short on purpose: every prompt token is prefilled before the first plan token.
"""

from __future__ import annotations

from .skills import SkillCatalog

SYSTEM = (
    "Plan the robot's task with these skills:\n{skills}\n"
    'Reply with JSON only: {{"plan": [{{"skill": NAME, "args": {{ARG: VALUE}}}}, ...]}}'
)


def system_prompt(catalog: SkillCatalog) -> str:
    lines = "\n".join(f"- {s.signature()}: {s.description}" for s in catalog.skills)
    return SYSTEM.format(skills=lines)


def user_prompt(task: str, context: str = "") -> str:
    text = f"Task: {task.strip()}"
    if context.strip():
        text += f"\nScene: {context.strip()}"
    return text


def build_messages(catalog: SkillCatalog, task: str, context: str = "") -> list[dict]:
    """Chat messages for the tokenizer's template (thinking on/off is the template's flag)."""
    return [{"role": "system", "content": system_prompt(catalog)},
            {"role": "user", "content": user_prompt(task, context)}]
