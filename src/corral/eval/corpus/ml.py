"""ml_training: small model fits, training loops, saved models and training jobs left running in the background.

Every fit is small (a few hundred samples, a few trees: well under a CPU-second once scikit-learn is imported)
because the point is the sandbox, not the model: the library must be there and work, a loop must make progress,
a model saved in one step must load in the next, and a job started with `nohup ... &` must keep running after
its command returned and leave its log to be read later. Accuracy floors sit well below what the seeded data
gives, so a failure is a broken environment, not an unlucky split.
"""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Iterable, Iterator

from .._checks import Check, CodeError, CodeText, Duration, ExitCode, Ok, RichResult, Stdout
from .._task import Blob, Code, Exec, Setup, Severity, Step, Task, Write

__all__ = ["tasks"]

CATEGORY = "ml_training"
PASS = "PASS\n"  # noqa: S105 - the word a script prints, not a password


def tasks() -> Iterable[Task]:
    yield from _sklearn_fits()
    yield from _numpy_training()
    yield from _persistence()
    yield from _background_jobs()
    yield from _notebook_training()


def _task(family: str, variant: str, title: str, steps: Iterable[Step], *, setup: Setup | None = None,
          severity: Severity = "high", budget: float = 120) -> Task:
    # scikit-learn takes over a CPU-second to import: the budget leaves room for a crowded machine.
    return Task(id=f"{family}/{variant}", family=family, category=CATEGORY, title=title, steps=tuple(steps),
                setup=setup or Setup(), severity=severity, budget=budget)


def _py(script: str, checks: tuple[Check, ...], timeout: float = 90) -> Exec:
    return Exec(("python3", "-c", script), (Ok(), ExitCode(0), *checks), timeout=timeout)


def _passes(mode: str = "wrong_result") -> Stdout:
    """The script prints PASS, or FAIL with the numbers that missed (shown in the failure's detail)."""
    return _out(PASS, mode)


def _out(text: str, mode: str = "wrong_result") -> Stdout:
    """Stdout is exactly `text`. An anchored pattern, not `equals`: a wrong answer is `mode`, not the byte-level
    mode (binary_corruption) that `equals` names for any difference, and the detail shows what was printed."""
    return Stdout(matches=r"\A" + re.escape(text) + r"\Z", mode=mode)


def _floor(metric: str, floor: float) -> str:
    return f"print('PASS' if {metric} >= {floor} else f'FAIL {metric}={{{metric}:.4f}} < {floor}')\n"


CLASSIFICATION = ("from sklearn.datasets import make_classification\n"
                  "from sklearn.model_selection import train_test_split\n"
                  "X, y = make_classification(n_samples=400, n_features=8, n_informative=5, class_sep=1.5, "
                  "random_state=0)\n"
                  "Xtr, Xte, ytr, yte = train_test_split(X, y, test_size=0.25, random_state=0)\n")


def _sklearn_fits() -> Iterator[Task]:
    family = "ml_training.sklearn_fit"
    classifiers: list[tuple[str, str, str, float]] = [
        ("logistic-regression", "logistic regression", "from sklearn.linear_model import LogisticRegression\n"
                                                        "m = LogisticRegression(max_iter=500)", 0.8),
        ("random-forest-10", "a random forest of 10 trees",
         "from sklearn.ensemble import RandomForestClassifier\n"
         "m = RandomForestClassifier(n_estimators=10, random_state=0)", 0.8),
        ("decision-tree", "a depth-5 decision tree", "from sklearn.tree import DecisionTreeClassifier\n"
                                                     "m = DecisionTreeClassifier(max_depth=5, random_state=0)", 0.75),
        ("knn", "k nearest neighbours", "from sklearn.neighbors import KNeighborsClassifier\n"
                                        "m = KNeighborsClassifier(n_neighbors=5)", 0.8),
        ("gaussian-nb", "Gaussian naive Bayes", "from sklearn.naive_bayes import GaussianNB\nm = GaussianNB()", 0.75),
        ("linear-svc", "a linear SVM", "from sklearn.svm import LinearSVC\nm = LinearSVC(dual=False)", 0.8),
        ("rbf-svc", "an RBF SVM", "from sklearn.svm import SVC\nm = SVC(gamma='scale')", 0.8),
        ("sgd-classifier", "an SGD classifier", "from sklearn.linear_model import SGDClassifier\n"
                                                "m = SGDClassifier(random_state=0)", 0.7),
        ("gradient-boosting-20", "gradient boosting with 20 stages",
         "from sklearn.ensemble import GradientBoostingClassifier\n"
         "m = GradientBoostingClassifier(n_estimators=20, random_state=0)", 0.8),
        ("pipeline-scaler-logreg", "a StandardScaler + logistic regression pipeline",
         "from sklearn.pipeline import make_pipeline\nfrom sklearn.preprocessing import StandardScaler\n"
         "from sklearn.linear_model import LogisticRegression\n"
         "m = make_pipeline(StandardScaler(), LogisticRegression())", 0.8),
        ("mlp-small", "a small multi-layer perceptron", "import warnings; warnings.simplefilter('ignore')\n"
                                                        "from sklearn.neural_network import MLPClassifier\n"
                                                        "m = MLPClassifier(hidden_layer_sizes=(16,), max_iter=300, "
                                                        "random_state=0)", 0.8),
    ]
    for variant, what, model, floor in classifiers:
        yield _task(family, variant, f"fit {what} on 300 samples; test accuracy at least {floor}",
                    [_py(CLASSIFICATION + model + "\nm.fit(Xtr, ytr)\nacc = m.score(Xte, yte)\n" + _floor("acc", floor),
                         (_passes(),))])
    # Noise-free data: the fitted coefficients are the ones the data was made with, to 6 places.
    coefs, intercept = (2.0, -3.0, 0.5), 4.0
    data = ("import numpy as np\nrng = np.random.default_rng(0)\nX = rng.normal(size=(200, 3))\n"
            f"y = X @ np.array({list(coefs)}) + {intercept}\n")
    expected = " ".join(str(c) for c in (*coefs, intercept)) + "\n"
    for variant, model in (("linear-regression", "from sklearn.linear_model import LinearRegression\n"
                                                  "m = LinearRegression()"),
                           ("ridge-tiny-alpha", "from sklearn.linear_model import Ridge\nm = Ridge(alpha=1e-9)")):
        yield _task(family, f"{variant}-recovers-coefficients", f"{variant} recovers y = 2a - 3b + 0.5c + 4 exactly",
                    [_py(data + model + "\nm.fit(X, y)\nprint(*[float(round(v, 6)) + 0.0 for v in m.coef_], "
                                        "float(round(m.intercept_, 6)) + 0.0)", (_out(expected),))])
    yield _task(family, "lasso-sparsity", "Lasso zeroes the coefficients of irrelevant features",
                [_py("import numpy as np\nfrom sklearn.linear_model import Lasso\nrng = np.random.default_rng(1)\n"
                     "X = rng.normal(size=(300, 6))\ny = 3 * X[:, 0] - 2 * X[:, 1]\n"
                     "m = Lasso(alpha=0.1).fit(X, y)\nprint(*[abs(c) < 1e-9 for c in m.coef_])",
                     (_out("False False True True True True\n"),))])
    yield _task(family, "kmeans-blobs", "k-means finds 3 well-separated blobs (adjusted Rand index >= 0.95)",
                [_py("from sklearn.datasets import make_blobs\nfrom sklearn.cluster import KMeans\n"
                     "from sklearn.metrics import adjusted_rand_score\n"
                     "X, y = make_blobs(n_samples=300, centers=3, cluster_std=0.5, random_state=0)\n"
                     "labels = KMeans(n_clusters=3, n_init=3, random_state=0).fit_predict(X)\n"
                     "ari = adjusted_rand_score(y, labels)\n" + _floor("ari", 0.95), (_passes(),))])
    yield _task(family, "pca-variance", "PCA of data lying on a plane: two components explain everything",
                [_py("import numpy as np\nfrom sklearn.decomposition import PCA\nrng = np.random.default_rng(2)\n"
                     "a = rng.normal(size=(200, 2))\nX = np.c_[a, a @ [1.5, -0.5]]\n"
                     "r = PCA(n_components=3).fit(X).explained_variance_ratio_\n"
                     "print(round(r[:2].sum(), 9), r[2] < 1e-12)", (_out("1.0 True\n"),))])
    yield _task(family, "iris-bundled-dataset", "the bundled iris data set loads offline and is learnable",
                [_py("from sklearn.datasets import load_iris\nfrom sklearn.linear_model import LogisticRegression\n"
                     "from sklearn.model_selection import cross_val_score\nX, y = load_iris(return_X_y=True)\n"
                     "print(X.shape)\nacc = cross_val_score(LogisticRegression(max_iter=500), X, y, cv=3).mean()\n"
                     + _floor("acc", 0.9), (_out("(150, 4)\n" + PASS),))])
    yield _task(family, "digits-bundled-dataset", "the bundled digits data set: a forest of 10 trees beats 85%",
                [_py("from sklearn.datasets import load_digits\nfrom sklearn.ensemble import RandomForestClassifier\n"
                     "from sklearn.model_selection import train_test_split\nX, y = load_digits(return_X_y=True)\n"
                     "Xtr, Xte, ytr, yte = train_test_split(X, y, random_state=0)\n"
                     "acc = RandomForestClassifier(n_estimators=10, random_state=0).fit(Xtr, ytr).score(Xte, yte)\n"
                     + _floor("acc", 0.85), (_passes(),))])
    yield _task(family, "grid-search", "a 2x2 grid search with 3-fold CV picks a model and scores it",
                [_py(CLASSIFICATION + "from sklearn.model_selection import GridSearchCV\n"
                     "from sklearn.tree import DecisionTreeClassifier\n"
                     "g = GridSearchCV(DecisionTreeClassifier(random_state=0), {'max_depth': [3, 6], "
                     "'min_samples_leaf': [1, 5]}, cv=3).fit(Xtr, ytr)\n"
                     "print(sorted(g.best_params_))\nacc = g.score(Xte, yte)\n" + _floor("acc", 0.7),
                     (_out("['max_depth', 'min_samples_leaf']\n" + PASS),))])
    yield _task(family, "confusion-matrix-shape", "classification_report and confusion_matrix cover every class",
                [_py("from sklearn.datasets import load_iris\nfrom sklearn.tree import DecisionTreeClassifier\n"
                     "from sklearn.metrics import confusion_matrix\nX, y = load_iris(return_X_y=True)\n"
                     "cm = confusion_matrix(y, DecisionTreeClassifier(random_state=0).fit(X, y).predict(X))\n"
                     "print(cm.shape, cm.sum(), cm.trace())", (_out("(3, 3) 150 150\n"),))])
    yield _task(family, "regression-r2", "a random forest regressor of 10 trees reaches R^2 >= 0.8",
                [_py("from sklearn.datasets import make_regression\n"
                     "from sklearn.ensemble import RandomForestRegressor\n"
                     "from sklearn.model_selection import train_test_split\n"
                     "X, y = make_regression(n_samples=400, n_features=5, noise=5.0, random_state=0)\n"
                     "Xtr, Xte, ytr, yte = train_test_split(X, y, random_state=0)\n"
                     "r2 = RandomForestRegressor(n_estimators=10, random_state=0).fit(Xtr, ytr).score(Xte, yte)\n"
                     + _floor("r2", 0.8), (_passes(),))])


def _numpy_training() -> Iterator[Task]:
    """Training loops written by hand: the loss must go down and the weights must arrive."""
    family = "ml_training.numpy_loop"
    np_ = "import numpy as np\nrng = np.random.default_rng(0)\n"
    cases: list[tuple[str, str, str, str]] = [
        ("linear-gd", "batch gradient descent for linear regression reaches the true weights",
         np_ + "X = rng.normal(size=(200, 3))\ny = X @ [1.5, -2.0, 0.5] + 1.0\nw = np.zeros(3); b = 0.0\n"
               "losses = []\nfor _ in range(300):\n    e = X @ w + b - y\n    losses.append(float((e ** 2).mean()))\n"
               "    w -= 0.1 * 2 * X.T @ e / len(y); b -= 0.1 * 2 * e.mean()\n"
               "print(all(a >= b - 1e-12 for a, b in zip(losses, losses[1:])), *np.round(np.r_[w, b], 3) + 0.0)",
         "True 1.5 -2.0 0.5 1.0\n"),
        ("logistic-gd", "logistic regression by gradient descent separates two blobs",
         np_ + "X = np.r_[rng.normal(-2, 1, (100, 2)), rng.normal(2, 1, (100, 2))]\ny = np.r_[np.zeros(100), "
               "np.ones(100)]\nw = np.zeros(2); b = 0.0\nfor _ in range(200):\n    p = 1 / (1 + np.exp(-(X @ w + b)))\n"
               "    w -= 0.5 * X.T @ (p - y) / len(y); b -= 0.5 * (p - y).mean()\n"
               "acc = ((X @ w + b > 0) == y).mean()\n" + _floor("acc", 0.95), PASS),
        ("minibatch-sgd", "mini-batch SGD: the last epoch's loss is a tenth of the first",
         np_ + "X = rng.normal(size=(512, 4))\ny = X @ [1., 2., 3., 4.]\nw = np.zeros(4)\nepoch_loss = []\n"
               "for epoch in range(20):\n    idx = rng.permutation(512); tot = 0.0\n"
               "    for i in range(0, 512, 32):\n        j = idx[i:i + 32]; e = X[j] @ w - y[j]\n"
               "        tot += float((e ** 2).sum()); w -= 0.05 * X[j].T @ e / 32\n    epoch_loss.append(tot / 512)\n"
               "ratio = epoch_loss[0] / max(epoch_loss[-1], 1e-300)\n" + _floor("ratio", 10), PASS),
        ("xor-mlp", "a 2-8-1 network learns XOR with backpropagation",
         np_ + "X = np.array([[0, 0], [0, 1], [1, 0], [1, 1]], float)\ny = np.array([[0], [1], [1], [0]], float)\n"
               "W1 = rng.normal(size=(2, 8)); b1 = np.zeros(8); W2 = rng.normal(size=(8, 1)); b2 = np.zeros(1)\n"
               "sig = lambda z: 1 / (1 + np.exp(-z))\nfor _ in range(2000):\n"
               "    h = np.tanh(X @ W1 + b1); o = sig(h @ W2 + b2)\n"
               "    d2 = o - y; d1 = (d2 @ W2.T) * (1 - h ** 2)\n    W2 -= 0.5 * h.T @ d2; b2 -= 0.5 * d2.sum(0)\n"
               "    W1 -= 0.5 * X.T @ d1; b1 -= 0.5 * d1.sum(0)\nprint(*(o.ravel() > 0.5).astype(int))", "0 1 1 0\n"),
        ("softmax-3-classes", "softmax regression on three blobs",
         np_ + "C = np.array([[0, 4], [4, -4], [-4, -4]])\nX = np.concatenate([rng.normal(c, 1, (60, 2)) for c in C])\n"
               "y = np.repeat(np.arange(3), 60)\nW = np.zeros((2, 3)); b = np.zeros(3); Y = np.eye(3)[y]\n"
               "for _ in range(300):\n    z = X @ W + b; p = np.exp(z - z.max(1, keepdims=True)); p /= p.sum(1, "
               "keepdims=True)\n    W -= 0.1 * X.T @ (p - Y) / len(y); b -= 0.1 * (p - Y).mean(0)\n"
               "acc = ((X @ W + b).argmax(1) == y).mean()\n" + _floor("acc", 0.95), PASS),
        ("kmeans-by-hand", "Lloyd's algorithm by hand converges on three blobs",
         np_ + "C = np.array([[0., 0.], [10., 0.], [0., 10.]])\n"
               "X = np.concatenate([rng.normal(c, 1, (50, 2)) for c in C])\n"
               "cent = X[[0, 50, 100]].copy()\nfor _ in range(20):\n"
               "    lab = ((X[:, None] - cent) ** 2).sum(-1).argmin(1)\n"
               "    cent = np.array([X[lab == k].mean(0) for k in range(3)])\n"
               "print(np.bincount(lab).tolist(), np.abs(cent - C).max() < 0.5)", "[50, 50, 50] True\n"),
        ("diverging-learning-rate", "a learning rate that is too high makes the loss grow, and the loop sees it",
         np_ + "X = rng.normal(size=(100, 2))\ny = X @ [1., 1.]\nw = np.zeros(2); losses = []\nfor _ in range(30):\n"
               "    e = X @ w - y; losses.append(float((e ** 2).mean())); w -= 5.0 * X.T @ e / len(y)\n"
               "print('diverged', losses[-1] > losses[0] * 1e6)", "diverged True\n"),
        ("gradient-check", "an analytic gradient matches finite differences",
         np_ + "X = rng.normal(size=(20, 3)); y = rng.normal(size=20); w = rng.normal(size=3)\n"
               "f = lambda w: ((X @ w - y) ** 2).mean()\ng = 2 * X.T @ (X @ w - y) / len(y)\n"
               "num = np.array([(f(w + h) - f(w - h)) / 2e-6 for h in np.eye(3) * 1e-6])\n"
               "print(np.max(np.abs(num - g)) / np.max(np.abs(g)) < 1e-6)", "True\n"),
        ("l2-regularisation", "weight decay shrinks the weights",
         np_ + "X = rng.normal(size=(50, 5)); y = X @ np.arange(1., 6.)\n"
               "def fit(lam):\n    return np.linalg.solve(X.T @ X + lam * np.eye(5), X.T @ y)\n"
               "print(np.linalg.norm(fit(100.)) < np.linalg.norm(fit(0.)))", "True\n"),
        ("early-stopping", "early stopping halts when validation loss stops improving",
         np_ + "X = rng.normal(size=(80, 20)); y = X[:, 0] + rng.normal(0, 1, 80)\nXt, yt, Xv, yv = X[:40], y[:40], "
               "X[40:], y[40:]\nw = np.zeros(20); best = np.inf; bad = 0\nfor epoch in range(2000):\n"
               "    w -= 0.05 * Xt.T @ (Xt @ w - yt) / 40\n    v = float(((Xv @ w - yv) ** 2).mean())\n"
               "    if v < best - 1e-6: best, bad = v, 0\n    else: bad += 1\n    if bad >= 10: break\n"
               "print('stopped early', epoch < 1999)", "stopped early True\n"),
        ("momentum-faster", "momentum reaches a loss threshold in fewer steps than plain descent",
         np_ + "A = np.diag([1., 50.]); x0 = np.array([1., 1.])\n"
               "def steps(beta):\n    x = x0.copy(); v = np.zeros(2)\n    for i in range(10000):\n"
               "        if x @ A @ x < 1e-8: return i\n"
               "        v = beta * v - 0.01 * 2 * A @ x; x = x + v\n    return 10000\n"
               "print(steps(0.9) < steps(0.0))", "True\n"),
        ("float32-training", "training in float32 keeps float32 and converges",
         np_ + "X = rng.normal(size=(100, 2)).astype(np.float32); y = (X @ np.array([2., -1.], np.float32))\n"
               "w = np.zeros(2, np.float32)\nfor _ in range(200): w -= np.float32(0.1) * X.T @ (X @ w - y) / 100\n"
               "print(w.dtype, *np.round(w, 3) + 0.0)", "float32 2.0 -1.0\n"),
    ]
    for variant, what, code, expected in cases:
        yield _task(family, variant, what, [_py(code, (_out(expected),))], budget=60)


def _linear(params: dict[str, object], x: list[float]) -> float:
    weights, bias = params["weights"], params["bias"]
    assert isinstance(weights, list) and isinstance(bias, float)
    return float(sum(a * b for a, b in zip(weights, x, strict=True))) + bias


def _persistence() -> Iterator[Task]:
    """A model saved in one step is loaded and used in a later one."""
    family = "ml_training.persistence"
    train = CLASSIFICATION + ("from sklearn.linear_model import LogisticRegression\n"
                              "m = LogisticRegression(max_iter=500).fit(Xtr, ytr)\n")
    check = CLASSIFICATION + "acc = m.score(Xte, yte)\n" + _floor("acc", 0.8)
    lost = (_passes("lost_state"),)
    between = Exec("ls -la /workspace > /dev/null && echo between", (_out("between\n"),))
    for variant, where, save, load in (
        ("pickle-workspace", "/workspace/model.pkl", "import pickle\npickle.dump(m, open('{p}', 'wb'))\n",
         "import pickle\nm = pickle.load(open('{p}', 'rb'))\n"),
        ("joblib-workspace", "/workspace/model.joblib", "import joblib\njoblib.dump(m, '{p}')\n",
         "import joblib\nm = joblib.load('{p}')\n"),
        ("joblib-compressed", "/workspace/model.joblib.gz", "import joblib\njoblib.dump(m, '{p}', compress=3)\n",
         "import joblib\nm = joblib.load('{p}')\n"),
        ("pickle-home-models", "/home/user/models/clf.pkl",
         "import os, pickle\nos.makedirs('/home/user/models', exist_ok=True)\npickle.dump(m, open('{p}', 'wb'))\n",
         "import pickle\nm = pickle.load(open('{p}', 'rb'))\n"),
        ("pickle-tmp", "/tmp/clf.pkl", "import pickle\npickle.dump(m, open('{p}', 'wb'))\n",
         "import pickle\nm = pickle.load(open('{p}', 'rb'))\n"),
    ):
        yield _task(family, variant, f"train, save to {where}, and in a later step load and score the model",
                    [_py(train + save.replace("{p}", where) + "print('saved')", (_out("saved\n"),)),
                     between, _py(load.replace("{p}", where) + check, lost)])
    yield _task(family, "npz-weights", "numpy weights saved with savez are reloaded bit for bit",
                [_py("import numpy as np\nrng = np.random.default_rng(3)\nW = rng.normal(size=(64, 32))\n"
                     "np.savez('/workspace/w.npz', W=W, b=np.arange(32))\nprint(float(W.sum()).hex())",
                     (Stdout(matches=r"^-?0x"),)),
                 between,
                 _py("import numpy as np\nrng = np.random.default_rng(3)\nd = np.load('/workspace/w.npz')\n"
                     "print(np.array_equal(d['W'], rng.normal(size=(64, 32))), int(d['b'].sum()))",
                     (_out("True 496\n", mode="lost_state"),))])
    params: dict[str, object] = {"weights": [0.5, -1.25, 2.0], "bias": 0.75, "classes": ["cat", "dog"]}
    yield _task(family, "json-params", "hyper-parameters and weights kept as JSON are read back by a later step",
                [Write("/workspace/params.json", Blob.literal(json.dumps(params))),
                 _py("import json\np = json.load(open('/workspace/params.json'))\nx = [2.0, 1.0, 0.5]\n"
                     "z = sum(a * b for a, b in zip(p['weights'], x)) + p['bias']\n"
                     "print(p['classes'][int(z > 0)], z)", (_out(f"dog {_linear(params, [2.0, 1.0, 0.5])}\n"),))])
    # A model trained elsewhere (here: by the corpus generator, as a plain-Python pickle) is uploaded and used.
    model = {"kind": "linear", "w": [1.0, -2.0, 0.5], "b": -0.25, "labels": ["neg", "pos"]}
    yield _task(family, "uploaded-pickle", "upload a pickled model through the file API and predict with it",
                [Write("/workspace/uploaded.pkl", Blob.literal(pickle.dumps(model, protocol=4))),
                 _py("import pickle\nm = pickle.load(open('/workspace/uploaded.pkl', 'rb'))\n"
                     "for x in ([1, 0, 0], [0, 1, 0], [0, 0, 1]):\n"
                     "    z = sum(a * b for a, b in zip(m['w'], x)) + m['b']\n    print(m['labels'][z > 0], z)",
                     (_out("pos 0.75\nneg -2.25\npos 0.25\n", mode="binary_corruption"),))],
                severity="critical")
    yield _task(family, "checkpoints-per-epoch", "a loop writes one checkpoint per epoch; a later step resumes "
                                                 "from the last",
                [_py("import numpy as np, os\nos.makedirs('/workspace/ckpt', exist_ok=True)\nw = np.zeros(2)\n"
                     "for epoch in range(5):\n    w = w + 1\n    np.save(f'/workspace/ckpt/epoch{epoch}.npy', w)\n"
                     "print('done')", (_out("done\n"),)),
                 between,
                 _py("import numpy as np, glob\nfiles = sorted(glob.glob('/workspace/ckpt/*.npy'))\n"
                     "w = np.load(files[-1])\nprint(len(files), *w)",
                     (_out("5 5.0 5.0\n", mode="lost_state"),))])
    yield _task(family, "code-cell-train-then-command-load", "a notebook cell trains and pickles; a command loads it",
                [Code(train + "import pickle\npickle.dump(m, open('/workspace/cell_model.pkl', 'wb'))\n'ok'",
                      (CodeText(equals="'ok'"),), timeout=90),
                 between,
                 _py("import pickle\nm = pickle.load(open('/workspace/cell_model.pkl', 'rb'))\n" + check, lost)])
    yield _task(family, "pickle-survives-many-steps", "a model saved in step 1 still loads in step 6",
                [_py(train + "import pickle\npickle.dump(m, open('/workspace/m.pkl', 'wb'))\nprint('saved')",
                     (_out("saved\n"),)),
                 *(Exec(f"echo step {i}", (_out(f"step {i}\n"),)) for i in range(2, 6)),
                 _py("import pickle\nm = pickle.load(open('/workspace/m.pkl', 'rb'))\n" + check, lost)])


TRAIN_SCRIPT = """\
import sys, time
import numpy as np
epochs = int(sys.argv[1]) if len(sys.argv) > 1 else 10
rng = np.random.default_rng(0)
X = rng.normal(size=(200, 3)); y = X @ [1.0, 2.0, 3.0]
w = np.zeros(3)
for epoch in range(epochs):
    e = X @ w - y
    w -= 0.5 * X.T @ e / len(y)
    print(f"epoch {epoch} loss {float((e ** 2).mean()):.6f}", flush=True)
    time.sleep(0.1)
np.save("/workspace/final_w.npy", w)
print("DONE", flush=True)
"""

# Wait (up to ~20 s) for a marker in a log, then show the log: what an agent polling its job does.
POLL = "for i in $(seq 1 100); do grep -q '{marker}' {log} 2>/dev/null && break; sleep 0.2; done; {show}"


def _poll(log: str, marker: str = "DONE", show: str = "") -> str:
    return POLL.format(marker=marker, log=log, show=show or f"tail -n 1 {log}")


def _background_jobs() -> Iterator[Task]:
    """A training job started in the background keeps running after its command returns."""
    family = "ml_training.background_job"
    setup = Setup(files=(("/workspace/train.py", Blob.literal(TRAIN_SCRIPT)),))
    done = _out("DONE\n", mode="lost_state")
    # The command returns at once: it does not wait for the job it put in the background.
    started = (ExitCode(0), Duration(max=15, mode="hang"))
    yield _task(family, "nohup", "nohup python3 train.py & returns at once; a later step sees the job finish",
                [Exec("nohup python3 train.py > train.log 2>&1 &\necho started",
                      (*started, _out("started\n"))),
                 Exec(_poll("train.log"), (done,), timeout=40)], setup=setup)
    yield _task(family, "setsid", "a job started with setsid keeps running after its command returns",
                [Exec("setsid python3 train.py > train.log 2>&1 < /dev/null &", started),
                 Exec(_poll("train.log"), (done,), timeout=40)], setup=setup)
    yield _task(family, "disown", "a disowned job keeps running",
                [Exec("python3 train.py > train.log 2>&1 & disown", started),
                 Exec(_poll("train.log"), (done,), timeout=40)], setup=setup)
    yield _task(family, "log-progress-between-steps", "the job's log grows between two polls",
                [Exec("nohup python3 -u train.py 30 > train.log 2>&1 &", started),
                 Exec(_poll("train.log", "epoch 2", "grep -c epoch train.log"), (Stdout(matches=r"^[0-9]+\n$"),),
                      timeout=40),
                 Exec(_poll("train.log"), (done,), timeout=40),
                 Exec("grep -c '^epoch' train.log", (_out("30\n", mode="lost_state"),))], setup=setup)
    yield _task(family, "result-file-after-job", "the weights the job saved are right when a later step reads them",
                [Exec("nohup python3 train.py 40 > train.log 2>&1 &", started),
                 Exec(_poll("train.log", show="python3 -c \"import numpy as np; "
                                            "print(*np.round(np.load('/workspace/final_w.npy'), 1))\""),
                      (_out("1.0 2.0 3.0\n", mode="lost_state"),), timeout=40)], setup=setup)
    yield _task(family, "pid-file-alive-then-gone", "the job's pid is alive while it runs and gone after",
                [Exec("nohup python3 train.py 30 > train.log 2>&1 & echo $! > train.pid", started),
                 Exec("kill -0 $(cat train.pid) && echo running", (_out("running\n", mode="lost_state"),)),
                 Exec(_poll("train.log", show="sleep 0.5; kill -0 $(cat train.pid) 2>/dev/null || echo finished"),
                      (_out("finished\n"),), timeout=40)], setup=setup)
    yield _task(family, "two-jobs-in-parallel", "two background jobs both finish with their own logs",
                [Exec("nohup python3 train.py 8 > a.log 2>&1 &\nnohup python3 train.py 12 > b.log 2>&1 &", started),
                 Exec(_poll("a.log") + "; " + _poll("b.log") + "; grep -c epoch a.log b.log",
                      (_out("DONE\nDONE\na.log:8\nb.log:12\n", mode="lost_state"),), timeout=50)], setup=setup)
    yield _task(family, "kill-job-later", "a later step stops the job; its log ends without DONE",
                [Exec("nohup python3 train.py 200 > train.log 2>&1 & echo $! > train.pid", started),
                 Exec(_poll("train.log", "epoch 3", "kill $(cat train.pid); sleep 0.5; "
                                                    "kill -0 $(cat train.pid) 2>/dev/null || echo stopped"),
                      (_out("stopped\n"),), timeout=40),
                 Exec("grep -c DONE train.log", (ExitCode(1), _out("0\n")))], setup=setup)
    yield _task(family, "background-with-wait", "a job backgrounded and waited for in the same command",
                [Exec("python3 train.py 5 > t.log 2>&1 &\nwait $!\necho \"status $?\"; tail -n 1 t.log",
                      (_out("status 0\nDONE\n"),), timeout=40)], setup=setup)
    yield _task(family, "sklearn-job-metrics", "a background scikit-learn job writes its metrics file",
                [Exec("cat > fit.py <<'EOF'\n" + CLASSIFICATION + "import json\nfrom sklearn.ensemble import "
                      "RandomForestClassifier\n"
                      "m = RandomForestClassifier(n_estimators=10, random_state=0).fit(Xtr, ytr)\n"
                      "json.dump({'acc': m.score(Xte, yte)}, open('metrics.json', 'w'))\nprint('DONE', flush=True)\n"
                      "EOF\nnohup python3 fit.py > fit.log 2>&1 &", started),
                 Exec(_poll("fit.log", show="python3 -c \"import json; a = json.load(open('metrics.json'))['acc']; "
                                            "print('PASS' if a >= 0.8 else a)\""),
                      (_passes("lost_state"),), timeout=60)], setup=setup)


def _notebook_training() -> Iterator[Task]:
    """Training in notebook cells: the model lives in the session between cells, even across an interrupt."""
    family = "ml_training.notebook"
    yield _task(family, "fit-then-predict", "fit in one cell, predict in the next",
                [Code(CLASSIFICATION + "from sklearn.linear_model import LogisticRegression\n"
                      "m = LogisticRegression(max_iter=500).fit(Xtr, ytr)", (), timeout=90),
                 Code("float(m.score(Xte, yte)) >= 0.8", (CodeText(equals="True", mode="lost_state"),))])
    yield _task(family, "interrupted-loop-keeps-progress", "a training loop cut by the cell's timeout keeps its "
                                                          "progress in the session",
                [Code("import time\nepochs_done = 0\nwhile True:\n    time.sleep(0.05)\n    epochs_done += 1",
                      (CodeError(name="KeyboardInterrupt", mode="timeout_not_enforced"),), timeout=2),
                 Code("epochs_done > 5", (CodeText(equals="True", mode="lost_state"),))], severity="medium")
    yield _task(family, "continue-training", "a second cell continues training the same weights",
                [Code("import numpy as np\nrng = np.random.default_rng(0)\nX = rng.normal(size=(100, 2))\n"
                      "y = X @ [3., -1.]\nw = np.zeros(2)\ndef step(n):\n    global w\n    for _ in range(n):\n"
                      "        w = w - 0.1 * X.T @ (X @ w - y) / 100\n    return float(((X @ w - y) ** 2).mean())\n"
                      "first = step(5)", ()),
                 Code("second = step(200)\n(second < first, [round(float(v), 3) + 0.0 for v in w])",
                      (CodeText(equals="(True, [3.0, -1.0])", mode="lost_state"),))])
    yield _task(family, "import-error-named", "a missing library is a ModuleNotFoundError naming it",
                [Code("import torch", (CodeError(name="ModuleNotFoundError", matches="torch"),))], severity="medium")
    yield _task(family, "loss-curve-png", "a loss curve plotted in a cell comes back as a PNG",
                [Code("import numpy as np, matplotlib.pyplot as plt\nloss = 1 / np.arange(1, 50)\nplt.plot(loss)\n"
                      "plt.yscale('log'); None", (RichResult(mime="image/png", min_size=2000),), timeout=90)],
                severity="medium")

