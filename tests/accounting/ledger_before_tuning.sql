-- A ledger written by fedmeta before tuning releases (commit b767799): 5 rounds, 2 cohorts.
-- anchor: {"head": "21cadb352c4a974b3624589bebde0effde972b541b2df17fabd6bd065d8657c6", "ledger_id": "aff7f23e5c184a0bb7b2181858abb854", "seq": 5, "spends": 5}
BEGIN TRANSACTION;
CREATE TABLE budgets (
        seq            INTEGER PRIMARY KEY AUTOINCREMENT,
        data_key       TEXT NOT NULL,
        number         INTEGER NOT NULL,
        federation_id  TEXT NOT NULL UNIQUE,
        reason         TEXT NOT NULL,
        actor          TEXT NOT NULL,
        created_at     TEXT NOT NULL,
        prev_hash      TEXT NOT NULL,
        hash           TEXT NOT NULL,
        UNIQUE (data_key, number)
    );
CREATE TABLE carried (
        federation_id  TEXT PRIMARY KEY REFERENCES federations(federation_id),
        label          TEXT NOT NULL,
        actor          TEXT NOT NULL,
        created_at     TEXT NOT NULL
    );
CREATE TABLE cohorts (
        cohort_id      TEXT PRIMARY KEY,
        federation_id  TEXT NOT NULL REFERENCES federations(federation_id),
        members        TEXT NOT NULL,
        created_at     TEXT NOT NULL
    );
INSERT INTO "cohorts" VALUES('8fe367edd1f9336d8923b23e2daa8c684c35fac7aeb6528e18c701cb5c7c3757','fed-before-tuning','["06861b11fcd98e74371e11692eab2a9c", "7e5d5ed07463edf6e272c986d291f7f1"]','2026-11-28');
INSERT INTO "cohorts" VALUES('70171795a0ea206697b7094bd279cefc51e21c55a1559b8c850bce52c735a9e1','fed-before-tuning','["06861b11fcd98e74371e11692eab2a9c"]','2026-11-28');
CREATE TABLE federations (
        federation_id  TEXT PRIMARY KEY,
        epsilon_budget REAL NOT NULL,
        delta          REAL NOT NULL,
        unit           TEXT NOT NULL,
        created_at     TEXT NOT NULL,
        neighbouring   TEXT
    );
INSERT INTO "federations" VALUES('fed-before-tuning',4.0,1.0e-05,'task','2026-11-28T00:20:09.699163+00:00','add_remove');
CREATE TABLE heads (
        federation_id  TEXT PRIMARY KEY,
        position       INTEGER NOT NULL,
        hash           TEXT NOT NULL
    );
INSERT INTO "heads" VALUES('fed-before-tuning',4,'21cadb352c4a974b3624589bebde0effde972b541b2df17fabd6bd065d8657c6');
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO "meta" VALUES('created_at','2026-11-28T00:20:09.670539+00:00');
INSERT INTO "meta" VALUES('ledger_id','aff7f23e5c184a0bb7b2181858abb854');
INSERT INTO "meta" VALUES('mode','secure');
INSERT INTO "meta" VALUES('salt','cad9c5cdde663d8f6cae274d6788cf7fc279f5c4502603ba9cf3a67c0bcd874e');
INSERT INTO "meta" VALUES('schema_version','3');
INSERT INTO "meta" VALUES('per_participant_budgets_after_seq','0');
CREATE TABLE participants (
        federation_id  TEXT NOT NULL REFERENCES federations(federation_id),
        participant    TEXT NOT NULL,
        name           TEXT NOT NULL,
        digest         TEXT NOT NULL,
        created_at     TEXT NOT NULL,
        UNIQUE (federation_id, participant, digest)
    );
CREATE TABLE public_data (
        federation_id  TEXT NOT NULL REFERENCES federations(federation_id),
        run_id         TEXT NOT NULL,
        declaration    TEXT NOT NULL,
        created_at     TEXT NOT NULL,
        UNIQUE (federation_id, run_id, declaration)
    );
CREATE TABLE rollbacks (
        seq               INTEGER PRIMARY KEY AUTOINCREMENT,
        anchor_ledger_id  TEXT NOT NULL,
        anchor_head       TEXT NOT NULL,
        found             TEXT NOT NULL,
        reason            TEXT NOT NULL,
        actor             TEXT NOT NULL,
        created_at        TEXT NOT NULL
    );
CREATE TABLE spends (
        seq            INTEGER PRIMARY KEY AUTOINCREMENT,
        federation_id  TEXT NOT NULL REFERENCES federations(federation_id),
        position       INTEGER NOT NULL,
        run_id         TEXT NOT NULL,
        round_index    INTEGER NOT NULL,
        event          TEXT NOT NULL,
        created_at     TEXT NOT NULL,
        prev_hash      TEXT NOT NULL,
        hash           TEXT NOT NULL, cohort TEXT,
        UNIQUE (federation_id, position)
    );
INSERT INTO "spends" VALUES(1,'fed-before-tuning',0,'run-a',0,'{"max_tasks_per_participant":null,"neighbouring":"add_remove","noise_multiplier":1.1,"scheme":"flat_poisson","scheme_params":{"rate":0.01}}','2026-11-28','3b688668bddf3741f7aa53c5230848babf8de61ee63faf0762ae713045f45b78','c3f64cd7b18eec759aff52e1ca44d448638c906bfb86416fb75c52a8588df910','8fe367edd1f9336d8923b23e2daa8c684c35fac7aeb6528e18c701cb5c7c3757');
INSERT INTO "spends" VALUES(2,'fed-before-tuning',1,'run-a',1,'{"max_tasks_per_participant":null,"neighbouring":"add_remove","noise_multiplier":1.1,"scheme":"flat_poisson","scheme_params":{"rate":0.01}}','2026-11-28','c3f64cd7b18eec759aff52e1ca44d448638c906bfb86416fb75c52a8588df910','9adf3fa71d7abbd56aa41ea751bb7aeebb21c1c1084c8ec13b6dd5c338c0521a','8fe367edd1f9336d8923b23e2daa8c684c35fac7aeb6528e18c701cb5c7c3757');
INSERT INTO "spends" VALUES(3,'fed-before-tuning',2,'run-a',2,'{"max_tasks_per_participant":null,"neighbouring":"add_remove","noise_multiplier":1.1,"scheme":"flat_poisson","scheme_params":{"rate":0.01}}','2026-11-28','9adf3fa71d7abbd56aa41ea751bb7aeebb21c1c1084c8ec13b6dd5c338c0521a','9ebd0ff4d3e03f97c7361d6a400810e5c9fedcced0c6423d7227ee9936c7f363','8fe367edd1f9336d8923b23e2daa8c684c35fac7aeb6528e18c701cb5c7c3757');
INSERT INTO "spends" VALUES(4,'fed-before-tuning',3,'run-b',0,'{"max_tasks_per_participant":null,"neighbouring":"add_remove","noise_multiplier":1.1,"scheme":"flat_poisson","scheme_params":{"rate":0.01}}','2026-11-28','9ebd0ff4d3e03f97c7361d6a400810e5c9fedcced0c6423d7227ee9936c7f363','973f6a356ff35d71ba4bced47334479a63fb86eec466ae0a579f338c031bb8dc','70171795a0ea206697b7094bd279cefc51e21c55a1559b8c850bce52c735a9e1');
INSERT INTO "spends" VALUES(5,'fed-before-tuning',4,'run-b',1,'{"max_tasks_per_participant":null,"neighbouring":"add_remove","noise_multiplier":1.1,"scheme":"flat_poisson","scheme_params":{"rate":0.01}}','2026-11-28','973f6a356ff35d71ba4bced47334479a63fb86eec466ae0a579f338c031bb8dc','21cadb352c4a974b3624589bebde0effde972b541b2df17fabd6bd065d8657c6','70171795a0ea206697b7094bd279cefc51e21c55a1559b8c850bce52c735a9e1');
CREATE TRIGGER spends_append_only_update BEFORE UPDATE ON spends BEGIN SELECT RAISE(ABORT, 'the privacy ledger is append-only'); END;
CREATE TRIGGER spends_append_only_delete BEFORE DELETE ON spends BEGIN SELECT RAISE(ABORT, 'the privacy ledger is append-only'); END;
CREATE TRIGGER federations_append_only_update BEFORE UPDATE ON federations BEGIN SELECT RAISE(ABORT, 'the privacy ledger is append-only'); END;
CREATE TRIGGER federations_append_only_delete BEFORE DELETE ON federations BEGIN SELECT RAISE(ABORT, 'the privacy ledger is append-only'); END;
CREATE TRIGGER budgets_append_only_update BEFORE UPDATE ON budgets BEGIN SELECT RAISE(ABORT, 'the privacy ledger is append-only'); END;
CREATE TRIGGER budgets_append_only_delete BEFORE DELETE ON budgets BEGIN SELECT RAISE(ABORT, 'the privacy ledger is append-only'); END;
CREATE TRIGGER meta_append_only_update BEFORE UPDATE ON meta BEGIN SELECT RAISE(ABORT, 'the privacy ledger is append-only'); END;
CREATE TRIGGER meta_append_only_delete BEFORE DELETE ON meta BEGIN SELECT RAISE(ABORT, 'the privacy ledger is append-only'); END;
CREATE TRIGGER cohorts_append_only_update BEFORE UPDATE ON cohorts BEGIN SELECT RAISE(ABORT, 'the privacy ledger is append-only'); END;
CREATE TRIGGER cohorts_append_only_delete BEFORE DELETE ON cohorts BEGIN SELECT RAISE(ABORT, 'the privacy ledger is append-only'); END;
CREATE TRIGGER participants_append_only_update BEFORE UPDATE ON participants BEGIN SELECT RAISE(ABORT, 'the privacy ledger is append-only'); END;
CREATE TRIGGER participants_append_only_delete BEFORE DELETE ON participants BEGIN SELECT RAISE(ABORT, 'the privacy ledger is append-only'); END;
CREATE TRIGGER carried_append_only_update BEFORE UPDATE ON carried BEGIN SELECT RAISE(ABORT, 'the privacy ledger is append-only'); END;
CREATE TRIGGER carried_append_only_delete BEFORE DELETE ON carried BEGIN SELECT RAISE(ABORT, 'the privacy ledger is append-only'); END;
CREATE TRIGGER rollbacks_append_only_update BEFORE UPDATE ON rollbacks BEGIN SELECT RAISE(ABORT, 'the privacy ledger is append-only'); END;
CREATE TRIGGER rollbacks_append_only_delete BEFORE DELETE ON rollbacks BEGIN SELECT RAISE(ABORT, 'the privacy ledger is append-only'); END;
CREATE TRIGGER public_data_append_only_update BEFORE UPDATE ON public_data BEGIN SELECT RAISE(ABORT, 'the privacy ledger is append-only'); END;
CREATE TRIGGER public_data_append_only_delete BEFORE DELETE ON public_data BEGIN SELECT RAISE(ABORT, 'the privacy ledger is append-only'); END;
DELETE FROM "sqlite_sequence";
INSERT INTO "sqlite_sequence" VALUES('spends',5);
COMMIT;
