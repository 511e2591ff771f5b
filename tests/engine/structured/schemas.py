"""JSON schemas of increasing difficulty, regexes and choice lists the embedded model must complete.

Strings are bounded (maxLength, enum or pattern): a small model rarely closes a free string on its own.
"""
NAME = {"type": "string", "maxLength": 8}

SCHEMAS = [
    {"type": "boolean"},
    {"type": "null"},
    {"const": "amen"},
    {"type": "integer", "minimum": 0, "maximum": 10},
    {"type": "integer", "minimum": -40, "maximum": -3},
    {"type": "string", "enum": ["red", "green", "blue"]},
    NAME,
    {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"},
    {"type": "object", "properties": {"name": NAME}, "required": ["name"]},
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"name": NAME, "alive": {"type": "boolean"}, "spouse": {"type": "null"}},
     "required": ["name", "alive", "spouse"]},
    {"type": "object", "properties": {"title": NAME, "verse": {"type": "integer", "minimum": 1, "maximum": 99}},
     "required": ["title"]},  # verse optional
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"enum": ["light", "darkness", "water"]}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"person": {
        "type": "object", "properties": {"name": NAME, "tribe": {"enum": ["Judah", "Levi", "Dan"]}},
        "required": ["name", "tribe"]}}, "required": ["person"]},
    {"type": "object", "properties": {"kings": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"name": NAME, "years": {"type": "integer", "minimum": 1, "maximum": 60}},
        "required": ["name", "years"]}}}, "required": ["kings"]},
    {"$defs": {"city": {"type": "object", "properties": {"name": NAME}, "required": ["name"]}},
     "type": "object", "properties": {"from": {"$ref": "#/$defs/city"}, "to": {"$ref": "#/$defs/city"}},
     "required": ["from", "to"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, NAME]}},
     "required": ["value"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1},
                                      "tags": {"type": "array", "items": NAME, "maxItems": 2}},
     "required": ["score", "tags"]},
    {"$defs": {"node": {"type": "object", "properties": {
        "label": {"enum": ["a", "b"]}, "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/leaf"}}},
        "required": ["label", "children"]},
        "leaf": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9}},
                 "required": ["id"]}},
     "type": "object", "properties": {"root": {"$ref": "#/$defs/node"}, "meta": {
         "type": "object", "properties": {"depth": {"enum": [1, 2, 3]}, "note": NAME}, "required": ["depth"]}},
     "required": ["root", "meta"]},
]

REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(yea|nay|amen)",
    r"[A-Z][a-z]{2,5} (begat|said) [A-Z][a-z]{2,5}",
    r"\d{1,2}:\d{1,2}",
]

CHOICES = [
    ["yea", "nay"],
    ["the LORD", "Moses", "a stranger in Egypt"],
]
