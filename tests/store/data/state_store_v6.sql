-- A state file written by the store before it was split by table family (schema 'store'
-- version 6), dumped with sqlite3's iterdump: every table holds a row. Never edit it.
BEGIN TRANSACTION;
CREATE TABLE compactions (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            desk TEXT NOT NULL,
            subagent_id TEXT,
            summary_id TEXT NOT NULL,
            summary TEXT NOT NULL,
            summary_created_at REAL NOT NULL,
            first_kept_id TEXT,
            first_kept_seq INTEGER NOT NULL,
            created_at REAL NOT NULL);
CREATE TABLE daily_usage (
            desk TEXT NOT NULL,
            day TEXT NOT NULL,
            requests INTEGER NOT NULL,
            input_tokens INTEGER NOT NULL,
            output_tokens INTEGER NOT NULL,
            cost REAL, cached_input_tokens INTEGER NOT NULL DEFAULT 0,
            PRIMARY KEY (desk, day));
INSERT INTO "daily_usage" VALUES('alpha','2025-06-15',1,100,20,0.5,40);
CREATE TABLE desk_holds (
            desk TEXT PRIMARY KEY,
            held_by TEXT NOT NULL,
            reason TEXT NOT NULL,
            held_at REAL NOT NULL,
            until REAL);
INSERT INTO "desk_holds" VALUES('alpha','ops','lunch',1750000000.0,1750000060.0);
CREATE TABLE equity_samples (
            desk TEXT NOT NULL,
            at REAL NOT NULL,
            equity REAL NOT NULL);
INSERT INTO "equity_samples" VALUES('alpha',1750000000.0,10000.0);
CREATE TABLE events (
            id INTEGER PRIMARY KEY,
            desk TEXT NOT NULL,
            turn TEXT,
            type TEXT NOT NULL,
            at REAL NOT NULL,
            data TEXT NOT NULL);
INSERT INTO "events" VALUES(7,'alpha','turn-1','usage',1750000000.0,'{"desk":"alpha","turn":"turn-1","subagent":null,"parent_call":null,"at":1750000000.0,"id":7,"input_tokens":100,"output_tokens":20,"estimated":false,"cost":0.5,"context_tokens":100,"context_window":8000,"cached_input_tokens":40,"type":"usage"}');
CREATE TABLE held_calls (
            desk TEXT NOT NULL,
            turn TEXT NOT NULL,
            call_id TEXT NOT NULL,
            approval_id TEXT NOT NULL,
            outcome TEXT,
            at REAL NOT NULL,
            PRIMARY KEY (desk, approval_id));
INSERT INTO "held_calls" VALUES('alpha','turn-1','call_1','appr-1','approved',1750000000.0);
CREATE TABLE images (
            sha256 TEXT PRIMARY KEY,
            media_type TEXT NOT NULL,
            data BLOB NOT NULL);
INSERT INTO "images" VALUES('f36bf9e04103cc69da884dcc3342c4c0d0a05794845518be189122351bb33592','image/png',X'89504E470D0A1A0A6368617274636861727463686172746368617274');
CREATE TABLE messages (
            seq INTEGER PRIMARY KEY AUTOINCREMENT,
            desk TEXT NOT NULL,
            message_id TEXT NOT NULL,
            role TEXT NOT NULL,
            kind TEXT NOT NULL,
            content TEXT NOT NULL,
            created_at REAL NOT NULL,
            subagent_id TEXT,
            parent_call_id TEXT, turn TEXT,
            UNIQUE (desk, message_id));
INSERT INTO "messages" VALUES(1,'alpha','m1','user','assistant','[{"type":"text","text":"[tick] BTC moved"}]',1750000000.0,NULL,NULL,'turn-1');
INSERT INTO "messages" VALUES(2,'alpha','m2','assistant','assistant','[{"type":"text","text":"Looking."},{"type":"tool_use","id":"call_1","name":"get_ticker","arguments":"{\"symbol\": \"BTC/USDT\"}"}]',1750000001.0,NULL,NULL,'turn-1');
INSERT INTO "messages" VALUES(3,'alpha','m3','user','tool_results','[{"type":"tool_result","tool_use_id":"call_1","is_error":false,"content":[{"type":"text","text":"last 64000"},{"type":"image","sha256":"f36bf9e04103cc69da884dcc3342c4c0d0a05794845518be189122351bb33592","media_type":"image/png","description":"1h chart","size":28}]}]',1750000002.0,NULL,NULL,'turn-1');
INSERT INTO "messages" VALUES(4,'alpha','m4','assistant','assistant','[{"type":"text","text":"Holding."}]',1750000003.0,NULL,NULL,'turn-1');
CREATE TABLE operator_messages (
            id TEXT PRIMARY KEY,
            desk TEXT NOT NULL,
            text TEXT NOT NULL,
            source TEXT NOT NULL,
            images TEXT NOT NULL,
            queued_at REAL NOT NULL,
            delivered_at REAL);
INSERT INTO "operator_messages" VALUES('op-1','alpha','buy less','api','[{"type": "image", "sha256": "f36bf9e04103cc69da884dcc3342c4c0d0a05794845518be189122351bb33592", "media_type": "image/png", "description": "chart", "size": 28}]',1750000004.0,NULL);
CREATE TABLE retracted_messages (
            desk TEXT NOT NULL,
            message_id TEXT NOT NULL,
            by TEXT NOT NULL,
            at REAL NOT NULL,
            PRIMARY KEY (desk, message_id));
INSERT INTO "retracted_messages" VALUES('alpha','m4','ops',1750000000.0);
CREATE TABLE schedule_state (
            desk TEXT NOT NULL,
            schedule TEXT NOT NULL,
            last_fired_at REAL NOT NULL,
            PRIMARY KEY (desk, schedule));
INSERT INTO "schedule_state" VALUES('alpha','hourly',1750000000.0);
CREATE TABLE schema_migrations ( component TEXT NOT NULL, version INTEGER NOT NULL, applied_at REAL NOT NULL, PRIMARY KEY (component, version));
INSERT INTO "schema_migrations" VALUES('store',1,1.79632260849182462695e+09);
INSERT INTO "schema_migrations" VALUES('store',2,1.79632260849248051644e+09);
INSERT INTO "schema_migrations" VALUES('store',3,1.79632260849282908441e+09);
INSERT INTO "schema_migrations" VALUES('store',4,1.79632260849324917797e+09);
INSERT INTO "schema_migrations" VALUES('store',5,1.79632260849365806582e+09);
INSERT INTO "schema_migrations" VALUES('store',6,1.79632260849488162995e+09);
CREATE TABLE spend_resumes (
            desk TEXT NOT NULL,
            day TEXT NOT NULL,
            PRIMARY KEY (desk, day));
INSERT INTO "spend_resumes" VALUES('alpha','2025-06-15');
CREATE TABLE store_meta (
            key TEXT PRIMARY KEY,
            value TEXT NOT NULL);
INSERT INTO "store_meta" VALUES('event_high_water','7');
CREATE TABLE subagents (
            subagent_id TEXT PRIMARY KEY,
            desk TEXT NOT NULL,
            parent_turn TEXT NOT NULL,
            parent_call_id TEXT NOT NULL,
            task TEXT NOT NULL,
            tools TEXT NOT NULL,
            started_at REAL NOT NULL);
CREATE TABLE turn_ends (
            desk TEXT NOT NULL,
            turn TEXT NOT NULL,
            how TEXT NOT NULL,
            at REAL NOT NULL,
            PRIMARY KEY (desk, turn));
INSERT INTO "turn_ends" VALUES('alpha','turn-1','answered',1750000000.0);
CREATE INDEX messages_by_desk ON messages (desk, subagent_id, seq);
CREATE INDEX compactions_by_desk ON compactions (desk, subagent_id, id);
CREATE INDEX events_by_desk ON events (desk, id);
CREATE INDEX operator_messages_waiting ON operator_messages (desk, delivered_at);
CREATE INDEX equity_samples_by_desk ON equity_samples (desk, at);
CREATE INDEX held_calls_by_turn ON held_calls (desk, turn);
DELETE FROM "sqlite_sequence";
INSERT INTO "sqlite_sequence" VALUES('messages',4);
COMMIT;
