"""The zoo's registers (scripts/make_zoo.py draws one per seed): the kind of chats and texts a model is trained
on, each a small set of templates and slot fillers. Text written for the project; licence MIT.

A register fills the slots every phrase template may use (COMMON_SLOTS) and its own. Per register:
    things, issues, actions, topics, goals   slot fillers (`thing` is fixed for one chat, the others vary)
    systems, user_first, user_follow         the user side (and the system prompt)
    openers, ordinary, closers, think        the assistant side ("ordinary": sentences without any phrase)
    notes                                    plain-text documents of the register (titles + sentences)
"""

from __future__ import annotations

from dataclasses import dataclass

COMMON_SLOTS = ("thing", "thing_bare", "goal", "action", "topic", "when", "n", "org", "person", "user", "place")
WHEN = ["tomorrow", "on Monday", "within two days", "by Friday", "later today", "this week", "next week"]


@dataclass(frozen=True)
class Register:
    name: str
    things: tuple[str, ...]
    issues: tuple[str, ...]
    actions: tuple[str, ...]
    topics: tuple[str, ...]
    goals: tuple[str, ...]
    systems: tuple[str, ...]
    user_first: tuple[str, ...]
    user_follow: tuple[str, ...]
    openers: tuple[str, ...]
    ordinary: tuple[str, ...]
    closers: tuple[str, ...]
    think: tuple[str, ...]
    note_titles: tuple[str, ...]
    notes: tuple[str, ...]


R = Register
REGISTERS: tuple[Register, ...] = (
    R("support",
      ("the router", "the coffee machine", "the robot vacuum", "the printer", "the parcel", "the phone plan",
       "the smart lamp", "the washing machine"),
      ("keeps dropping out", "will not turn on", "shows a red light", "restarts every night", "makes a loud noise",
       "was charged twice", "has not arrived", "stopped working"),
      ("unplug it for thirty seconds", "update the firmware", "reset it to the factory settings",
       "check the cable at the back", "send a photo of the label", "sign out and sign in again",
       "clean the filter", "check the tracking link"),
      ("your account history", "the error codes", "the delivery logs", "your billing records", "the settings",
       "what went wrong"),
      ("sort this out", "get it fixed", "make this right", "find the cause", "get you a replacement",
       "get the refund through"),
      ("You are a customer support agent for {org}.", "You are {person}, a friendly support agent at {org}.",
       "You are a helpful support assistant. Be polite and brief."),
      ("Hi, {thing} {issue}. Can you help?", "{Thing} {issue} since yesterday. What should I do?",
       "Hello, I need help. {Thing} {issue}.", "I bought {thing} from {org} and it {issue}.",
       "Can I get a refund? {Thing} {issue}."),
      ("I tried that and it still {issue}.", "OK, done. What next?", "How long will that take?",
       "It worked, thank you!", "Do I need to send it back?"),
      ("Hi {user}, thanks for reaching out.", "Hello {user}, I am {person} from {org} support.",
       "Thanks for the details, {user}.", "I am sorry to hear that {thing} {issue}.", "Hi, happy to help."),
      ("Please {action}.", "Could you {action} and tell me what happens?", "First, {action}.", "Then {action}.",
       "If that does not help, {action}.", "I have logged the case for you.", "A refund takes {n} working days.",
       "You will get an email when it ships.", "I have added a note to your order.", "Thank you for waiting.",
       "I am sorry about the trouble.", "The depot in {place} scanned it {when}."),
      ("Is there anything else I can help with?", "Have a good day!", "Let me know how it goes.",
       "Thanks for your patience."),
      ("The customer says {thing} {issue}.", "I should ask them to {action}.", "I should apologise and give one step.",
       "If the first step fails, a replacement is next."),
      ("Support note {n}", "Ticket summary", "Known issue: {thing_bare}"),
      ("Customers report that {thing} {issue}.", "The usual fix is to {action}.", "Most cases close within {n} days.",
       "Agents should {action} before they escalate.", "The team in {place} handles returns.")),
    R("reviews",
      ("the headphones", "the blender", "the backpack", "the desk chair", "the kettle", "the rain jacket",
       "the e-reader", "the air fryer"),
      ("feels a bit cheap", "is louder than I hoped", "broke after a month", "is smaller than it looks",
       "works better than expected", "took long to arrive"),
      ("read the manual first", "charge it fully before use", "wash it by hand", "order one size up",
       "register it for the warranty", "keep the box for returns"),
      ("the build quality", "the battery life", "the price", "the comfort", "the design", "the sound"),
      ("find the right one", "pick a good model", "save some money", "get the most out of it"),
      ("You write short, honest product reviews.", "You are a shopping assistant for {org}.",
       "You help people compare products."),
      ("Can you write a short review of {thing}?", "Is {thing} worth buying?", "Write a review of {thing} for {org}.",
       "What do you think of {thing}? Mine {issue}.", "Give me a quick review of {thing}."),
      ("What about {topic}?", "Would you buy it again?", "Is there a cheaper option?", "Thanks, that helps."),
      ("Here is a short review.", "Sure, here are my thoughts.", "Good question.", "I have used {thing} for {n} weeks."),
      ("Setup took about ten minutes.", "The manual is short but clear.", "After a month it still works well.",
       "It is quieter than the old one.", "Three stars, because it {issue}.", "Four stars, mostly for {topic}.",
       "My partner uses it every day.", "The cable could be longer.", "I ordered it from {org} in {place}.",
       "I would {action}."),
      ("Hope that helps.", "Overall, a solid buy.", "I would recommend it.", "Your mileage may vary."),
      ("They want an honest review of {thing}.", "I should mention {topic}.", "Keep it short and balanced."),
      ("Review: {thing_bare}", "{n} weeks with {thing_bare}", "Buyer notes"),
      ("I bought {thing} {n} weeks ago.", "Honestly, it {issue}.", "The best part is {topic}.",
       "If you buy one, {action}.", "Five stars for {topic}.", "It arrived at my flat in {place} quickly.")),
    R("recipes",
      ("the lentil soup", "the banana bread", "the tomato risotto", "the apple crumble", "the chickpea curry",
       "the oat cookies", "the flatbread", "the pumpkin soup"),
      ("came out too dry", "is too salty", "did not rise", "burned at the bottom", "tastes bland",
       "fell apart in the pan"),
      ("add a splash of water", "lower the heat", "rest the dough for {n} minutes", "stir it every few minutes",
       "use fresh yeast", "season it at the end", "bake it for {n} minutes longer"),
      ("the spices", "the oven temperature", "the cooking time", "the flour", "the texture", "the timing"),
      ("get it right", "make it taste better", "cook it in one pan", "save some time"),
      ("You are a friendly cooking assistant.", "You are {person}, a home cook who answers questions.",
       "You help people cook simple meals."),
      ("How do I make {thing}?", "My {thing_bare} {issue}. What went wrong?", "Can I make {thing} without eggs?",
       "What goes well with {thing}?", "{Thing} {issue} again. Any tips?"),
      ("Can I freeze it?", "How long does it keep?", "What if I have no oven?", "Thanks, I will try that."),
      ("Good question.", "Happy to help.", "That happens a lot.", "Here is a simple way to do it."),
      ("Mix the flour and the salt in a bowl.", "Turn the heat down and simmer for {n} minutes.",
       "Cut the onions into small cubes.", "Season with salt and pepper.", "Let it cool before you slice it.",
       "Please {action}.", "Then {action}.", "It keeps for {n} days in the fridge.", "Stir in the herbs at the end."),
      ("Enjoy your meal!", "Let me know how it turns out.", "Happy cooking.", "Good luck with it."),
      ("The dish {issue}, so {topic} is likely off.", "I should suggest they {action}.", "Keep it simple."),
      ("{Thing_bare} (serves {n})", "Weeknight {thing_bare}", "Notes on {thing_bare}"),
      ("Mix the dry parts first.", "Pour the milk into the bowl and stir.", "Put the tray into the oven.",
       "Fold the fruit into the batter.", "If it {issue}, {action}.", "Serve it warm.")),
    R("travel",
      ("the train ticket", "the hotel booking", "the flight", "the rental car", "the ferry", "the city pass",
       "the hostel room", "the museum tour"),
      ("was cancelled", "costs more than expected", "is fully booked", "got moved to another day",
       "has no refund option", "is hard to find"),
      ("book a week ahead", "check the station board", "pack a light bag", "carry a printed copy",
       "ask at the front desk", "arrive an hour early", "buy the pass online"),
      ("the best season", "local food", "the old town", "getting around", "the budget", "the weather"),
      ("plan the trip", "find a cheaper route", "see the main sights", "make the most of your stay"),
      ("You are a travel assistant.", "You are {person}, a travel planner at {org}.",
       "You help people plan short trips."),
      ("I am going to {place} {when}. Any tips?", "{Thing} {issue}. What can I do?",
       "How do I get from {place} to the coast?", "Is {thing} worth it in {place}?", "Help me plan two days in {place}."),
      ("What about {topic}?", "Is it safe at night?", "How much should I budget?", "Great, thanks!"),
      ("Great choice.", "Happy to help you plan.", "Sure, here is what I would do.", "Good question."),
      ("The old town of {place} is small enough to walk.", "Trains leave every {n} minutes.",
       "Please {action}.", "Most museums close on Mondays.", "A day pass costs about {n} euros.",
       "The bus stops near the harbour.", "Then {action}.", "The weather is mild {when}."),
      ("Have a great trip!", "Enjoy {place}!", "Safe travels.", "Let me know if you need more."),
      ("They are going to {place}.", "I should mention {topic}.", "A simple plan works best."),
      ("Two days in {place}", "Guide: {place}", "Travel notes"),
      ("{Place} sits by the river.", "The market opens early.", "Most visitors {action}.",
       "Ask about {topic} at the office.", "The walk from the station takes {n} minutes.")),
    R("finance",
      ("the savings account", "the credit card", "the monthly budget", "the loan", "the pension plan",
       "the tax return", "the invoice", "the transfer"),
      ("shows a fee I do not know", "was declined", "is higher than last year", "has not cleared",
       "was charged twice", "looks wrong"),
      ("check the statement", "set up a standing order", "compare the rates", "call the bank",
       "keep the receipts", "pay off the card each month", "put a little aside each week"),
      ("interest rates", "the fees", "your spending", "the tax rules", "saving for later", "the budget"),
      ("save more", "cut the fees", "plan the year", "keep track of spending"),
      ("You are a personal finance assistant.", "You are {person}, an adviser at {org}.",
       "You explain money matters simply."),
      ("{Thing} {issue}. Why?", "How do I start with {topic}?", "Should I close {thing}?",
       "My {thing_bare} {issue}. What now?", "Can you explain {topic}?"),
      ("What about {topic}?", "Is that safe?", "How much should I put aside?", "Thanks, that is clear."),
      ("Good question.", "Happy to help.", "Let me explain.", "That is a common worry."),
      ("Please {action}.", "Most banks charge a small fee.", "Rates change every {n} months.",
       "Then {action}.", "Keep a buffer of {n} weeks of costs.", "A transfer clears in {n} days.",
       "The branch in {place} opens at nine.", "Write the amount in the notes."),
      ("I hope that helps.", "Good luck with your plans.", "Feel free to ask more."),
      ("They worry that {thing} {issue}.", "I should explain {topic}.", "Keep it simple and safe."),
      ("Budget notes", "Monthly plan", "About {topic}"),
      ("The plan is to {action}.", "Costs went up by {n} percent.", "It helps to {action}.",
       "Most people forget {topic}.", "The statement arrives {when}.")),
    R("code",
      ("the build", "the test suite", "the deploy script", "the login page", "the cache layer", "the API client",
       "the backup job", "the import script"),
      ("fails on the server", "is slow", "throws an error", "times out", "uses too much memory",
       "logs nothing"),
      ("clear the cache", "pin the version", "add a log line", "run the tests again", "check the config file",
       "restart the worker", "read the stack trace"),
      ("the error message", "the logs", "the config", "the dependencies", "the timeout", "the database"),
      ("fix the bug", "speed it up", "find the cause", "make it stable"),
      ("You are a helpful coding assistant.", "You are {person}, a senior engineer at {org}.",
       "You answer programming questions briefly."),
      ("{Thing} {issue}. Any idea why?", "Why does {thing} {issue}?", "How do I debug {thing}?",
       "My {thing_bare} {issue} since the update.", "Can you help with {topic}?"),
      ("I tried that and it still {issue}.", "What about {topic}?", "That worked, thanks!", "Any other ideas?"),
      ("Good question.", "Sure.", "That is a common problem.", "Let us look at it."),
      ("Please {action}.", "First, {action}.", "Then {action}.", "The error usually means a missing file.",
       "Run it with the debug flag.", "Check line {n} of the log.", "It often works after a restart.",
       "The server in {place} has its own config."),
      ("Hope that helps.", "Good luck!", "Let me know what the logs say."),
      ("The user says {thing} {issue}.", "This sounds like {topic}.", "I should suggest they {action}."),
      ("Runbook: {thing_bare}", "Incident {n}", "Notes on {topic}"),
      ("{Thing} {issue} after the change.", "The fix was to {action}.", "Tests take {n} minutes.",
       "Always {action} first.", "The team in {place} owns it.")),
    R("fitness",
      ("the running plan", "the gym routine", "the yoga class", "the bike ride", "the swim session",
       "the stretching routine", "the step goal", "the home workout"),
      ("leaves my knees sore", "feels too easy", "takes too long", "is hard to keep up", "makes me tired",
       "stopped helping"),
      ("warm up for ten minutes", "drink more water", "rest one day a week", "add one set each week",
       "stretch after each session", "sleep a bit longer", "slow the pace"),
      ("recovery", "the warm up", "sleep", "the pace", "good form", "the schedule"),
      ("get stronger", "stay on track", "avoid injury", "build a habit"),
      ("You are a friendly fitness coach.", "You are {person}, a coach at {org}.", "You give safe, simple exercise tips."),
      ("{Thing} {issue}. What should I change?", "How do I start {thing}?", "Is {thing} enough for a beginner?",
       "My {thing_bare} {issue}.", "Can you help with {topic}?"),
      ("What about {topic}?", "How often should I do it?", "Thanks, I will try.", "Is that safe for my back?"),
      ("Good question.", "Great that you asked.", "Happy to help.", "That is normal at the start."),
      ("Please {action}.", "Start with {n} minutes a day.", "Then {action}.", "Form matters more than speed.",
       "Most people see progress in {n} weeks.", "The park in {place} has a good loop.", "Keep a short log."),
      ("Keep going!", "You have got this.", "Let me know how it feels."),
      ("They say {thing} {issue}.", "I should mention {topic}.", "Keep the advice safe."),
      ("Week {n} plan", "Coach notes", "About {topic}"),
      ("The plan is to {action}.", "Rest days matter.", "Most beginners {action}.", "Track {topic} each week.",
       "The class in {place} starts at six.")),
)


def by_name() -> dict[str, Register]:
    return {r.name: r for r in REGISTERS}
