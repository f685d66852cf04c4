"""Forty-five JSON Schemas of real-world shape, each with the request a user would send.

Shapes covered: nested objects, arrays with minItems/maxItems, enums, anyOf/oneOf, const,
nullable types, bounded integers and numbers, string patterns, $ref into $defs, top-level
arrays and enums. Free-text strings carry a maxLength, as strict production schemas do, so a
135M model's outputs end within the test's token budget.
"""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 30}
TEXT = {"type": "string", "maxLength": 60}
DATE = {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"}
TIME = {"type": "string", "pattern": r"^\d{2}:\d{2}$"}


def obj(required: dict, optional: dict | None = None, **extra) -> dict:
    """An object schema whose `required` properties are all required; no other keys allowed."""
    return {"type": "object", "properties": {**required, **(optional or {})},
            "required": list(required), "additionalProperties": False, **extra}


PERSON = obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})

SCHEMAS: list[tuple[str, dict]] = [
    ("a person", obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                      "email": {"type": "string", "pattern": r"^[a-z0-9.]{1,20}@[a-z]{1,12}\.(com|org|net)$"}})),
    ("a postal address in the US", obj({"street": NAME, "city": NAME,
                                        "zip": {"type": "string", "pattern": r"^\d{5}$"},
                                        "country": {"enum": ["US", "CA", "MX"]}})),
    ("a product in a shop", obj({"id": {"type": "integer", "minimum": 1, "maximum": 99999}, "name": NAME,
                                 "price": {"type": "number", "minimum": 0, "maximum": 10000},
                                 "tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}})),
    ("an order of two items", {
        "$defs": {"item": obj({"sku": {"type": "string", "pattern": r"^[A-Z]{3}-\d{3}$"},
                               "quantity": {"type": "integer", "minimum": 1, "maximum": 9}})},
        **obj({"order_id": {"type": "integer", "minimum": 1, "maximum": 999999},
               "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1, "maxItems": 3}})}),
    ("the weather in a city", obj({"city": NAME, "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
                                   "conditions": {"enum": ["sunny", "cloudy", "rain", "snow", "storm"]}})),
    ("a meeting", obj({"title": NAME, "date": DATE,
                       "attendees": {"type": "array", "items": NAME, "maxItems": 3}})),
    ("a book", obj({"title": NAME, "author": NAME, "year": {"type": "integer", "minimum": 1400, "maximum": 2025},
                    "isbn": {"type": "string", "pattern": r"^97[89]-\d{10}$"}})),
    ("a way to contact someone (email or phone)", {"anyOf": [
        obj({"email": {"type": "string", "pattern": r"^[a-z]{1,12}@[a-z]{1,12}\.com$"}}),
        obj({"phone": {"type": "string", "pattern": r"^\+?\d{7,12}$"}})]}),
    ("a call of the get_weather tool", obj({
        "name": {"const": "get_weather"},
        "arguments": obj({"location": NAME, "unit": {"enum": ["celsius", "fahrenheit"]}})})),
    ("a company with its CEO and staff", {
        "$defs": {"person": PERSON},
        **obj({"name": NAME, "ceo": {"$ref": "#/$defs/person"},
               "employees": {"type": "array", "items": {"$ref": "#/$defs/person"}, "maxItems": 2}})}),
    ("feature flags of an app", obj({"dark_mode": {"type": "boolean"}, "beta": {"type": "boolean"},
                                     "telemetry": {"type": "boolean"}})),
    ("a review of a restaurant", obj({"stars": {"type": "integer", "minimum": 1, "maximum": 5},
                                      "comment": {"type": "string", "maxLength": 50}})),
    ("a color theme", obj({"primary": {"type": "string", "pattern": r"^#[0-9a-fA-F]{6}$"},
                           "secondary": {"type": "string", "pattern": r"^#[0-9a-fA-F]{6}$"}})),
    ("the coordinates of Paris", obj({"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                      "lon": {"type": "number", "minimum": -180, "maximum": 180}})),
    ("a movie", obj({"title": NAME, "genres": {"type": "array", "minItems": 1, "maxItems": 2,
                                               "items": {"enum": ["drama", "comedy", "action", "horror", "sci-fi"]}},
                     "rating": {"type": "number", "minimum": 0, "maximum": 10}})),
    ("a pancake recipe", obj({"name": NAME,
                              "ingredients": {"type": "array", "minItems": 1, "maxItems": 3,
                                              "items": obj({"item": NAME, "grams": {"type": "integer", "minimum": 1,
                                                                                    "maximum": 1000}})},
                              "steps": {"type": "array", "items": TEXT, "minItems": 1, "maxItems": 2}})),
    ("an HTTP request", obj({"method": {"enum": ["GET", "POST", "PUT", "DELETE"]},
                             "url": {"type": "string", "pattern": r"^https?://[a-z]{1,15}\.[a-z]{2,3}(/[a-z]{1,10}){0,2}$"},
                             "timeout_s": {"type": "integer", "minimum": 1, "maximum": 60}})),
    ("the sentiment of 'I love this phone'", obj({"label": {"enum": ["positive", "negative", "neutral"]},
                                                   "confidence": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("the named entities in 'Alice flew to Berlin'", obj({"entities": {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": obj({"text": NAME, "type": {"enum": ["PERSON", "LOCATION", "ORG"]}})}})),
    ("a measurement that is a number or a string", obj({"value": {"anyOf": [{"type": "number"}, NAME]},
                                                        "unit": {"enum": ["m", "kg", "s"]}})),
    ("a user whose nickname may be null", obj({"username": NAME,
                                               "nickname": {"anyOf": [NAME, {"type": "null"}]}})),
    ("an API version record", obj({"api": {"const": "v2"}, "deprecated": {"type": "boolean"}})),
    ("a user profile with preferences", obj({
        "user": PERSON,
        "preferences": obj({"language": {"enum": ["en", "fr", "de"]}, "newsletter": {"type": "boolean"}})})),
    ("an invoice", {
        "$defs": {"line": obj({"description": NAME, "amount": {"type": "number", "minimum": 0, "maximum": 5000}})},
        **obj({"invoice_no": {"type": "string", "pattern": r"^INV-\d{4}$"},
               "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}, "minItems": 1, "maxItems": 3},
               "currency": {"enum": ["USD", "EUR", "GBP"]}})}),
    ("free slots on a weekday", obj({"day": {"enum": ["mon", "tue", "wed", "thu", "fri"]},
                                     "slots": {"type": "array", "items": TIME, "minItems": 1, "maxItems": 2}})),
    ("an API error", obj({"code": {"type": "integer", "minimum": 400, "maximum": 599}, "message": TEXT})),
    ("a flight", obj({"from": {"type": "string", "pattern": r"^[A-Z]{3}$"},
                      "to": {"type": "string", "pattern": r"^[A-Z]{3}$"}, "departure": TIME, "date": DATE})),
    ("a pet", obj({"species": {"enum": ["dog", "cat", "bird"]}, "name": NAME,
                   "age": {"type": "integer", "minimum": 0, "maximum": 30}, "vaccinated": {"type": "boolean"}})),
    ("a GitHub issue", obj({"title": TEXT, "labels": {"type": "array", "maxItems": 2,
                                                      "items": {"enum": ["bug", "feature", "docs"]}},
                            "priority": {"type": "integer", "minimum": 1, "maximum": 4}})),
    ("the answer to 12 * 7", obj({"answer": {"type": "integer"}, "reasoning": {"type": "string", "maxLength": 80}})),
    ("a translation job", obj({"source": {"enum": ["en", "fr", "es"]}, "target": {"enum": ["en", "fr", "es"]},
                               "text": TEXT})),
    ("a server configuration", obj({"host": NAME, "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                                    "tls": {"type": "boolean"},
                                    "replicas": {"type": "integer", "minimum": 1, "maximum": 10}})),
    ("a patient's vital signs", obj({"patient_id": {"type": "string", "pattern": r"^P\d{4}$"},
                                     "vitals": obj({"heart_rate": {"type": "integer", "minimum": 30, "maximum": 200},
                                                    "blood_pressure": {"type": "string",
                                                                       "pattern": r"^\d{2,3}/\d{2,3}$"}})})),
    ("a quiz question", obj({"question": TEXT, "options": {"type": "array", "items": NAME, "minItems": 2,
                                                           "maxItems": 4},
                             "answer_index": {"type": "integer", "minimum": 0, "maximum": 3}})),
    ("a shape: a circle or a rectangle", {"oneOf": [
        obj({"kind": {"const": "circle"}, "radius": {"type": "number", "minimum": 0, "maximum": 100}}),
        obj({"kind": {"const": "rectangle"}, "width": {"type": "number", "minimum": 0, "maximum": 100},
             "height": {"type": "number", "minimum": 0, "maximum": 100}})]}),
    ("a log entry", obj({"level": {"enum": ["DEBUG", "INFO", "WARN", "ERROR"]},
                         "timestamp": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z$"},
                         "message": TEXT})),
    ("a stock quote", obj({"symbol": {"type": "string", "pattern": r"^[A-Z]{1,5}$"},
                           "price": {"type": "number", "minimum": 0, "maximum": 100000},
                           "change_pct": {"type": "number", "minimum": -100, "maximum": 100}})),
    ("the top three players and scores", {"type": "array", "minItems": 1, "maxItems": 3,
                                          "items": obj({"name": NAME, "score": {"type": "integer", "minimum": 0,
                                                                                "maximum": 1000}})}),
    ("the size of a T-shirt", {"enum": ["XS", "S", "M", "L", "XL"]}),
    ("a 2x2 matrix of small integers", obj({"matrix": {
        "type": "array", "minItems": 1, "maxItems": 2,
        "items": {"type": "array", "minItems": 1, "maxItems": 2,
                  "items": {"type": "integer", "minimum": -9, "maximum": 9}}}})),
    ("a payment by card or bank transfer", obj({"amount": {"type": "number", "minimum": 0, "maximum": 10000},
                                                "method": {"oneOf": [
                                                    obj({"card_last4": {"type": "string", "pattern": r"^\d{4}$"}}),
                                                    obj({"iban": {"type": "string",
                                                                  "pattern": r"^[A-Z]{2}\d{2}[A-Z0-9]{8,16}$"}})]}})),
    ("a to-do list", obj({"tasks": {"type": "array", "minItems": 1, "maxItems": 3,
                                    "items": obj({"id": {"type": "integer", "minimum": 1, "maximum": 99},
                                                  "title": NAME, "done": {"type": "boolean"}})}})),
    ("a car", obj({"make": {"enum": ["Toyota", "Ford", "Tesla", "BMW"]}, "model": NAME,
                   "year": {"type": "integer", "minimum": 1950, "maximum": 2026}, "electric": {"type": "boolean"}})),
    ("a three-day weather forecast", {
        "$defs": {"day": obj({"date": DATE, "high_c": {"type": "integer", "minimum": -40, "maximum": 50},
                              "low_c": {"type": "integer", "minimum": -50, "maximum": 40}})},
        **obj({"city": NAME, "days": {"type": "array", "items": {"$ref": "#/$defs/day"},
                                      "minItems": 1, "maxItems": 3}})}),
    ("a login form with optional fields", obj({"username": NAME},
                                              {"remember_me": {"type": "boolean"},
                                               "otp": {"type": "string", "pattern": r"^\d{6}$"}})),
]
